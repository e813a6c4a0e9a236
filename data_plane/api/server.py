"""`loraplane engine`: parse flags into an EngineConfig, load the model, serve the API with uvicorn.

This is the only place that reads the command line or the environment for an engine process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING

from shared.errors import LoraplaneError
from shared.listen import listening_socket
from shared.logging_setup import LOG_FORMAT_ENV, add_log_format_argument, configure_logging

if TYPE_CHECKING:
    from data_plane.config import EngineConfig
    from data_plane.engine.core.client import EngineCoreClient
    from data_plane.engine.core.process import CoreProcess
    from data_plane.engine.protocol import EngineProtocol

logger = logging.getLogger("loraplane.engine")


def build_parser() -> argparse.ArgumentParser:
    from data_plane.config import LONG_PREFILL_TOKENS  # plain constants, no torch

    p = argparse.ArgumentParser(
        prog="loraplane engine", description="Serve a model over an OpenAI-compatible API.",
        usage="%(prog)s [MODEL | --model MODEL] [options]",
    )
    # `loraplane engine MODEL`, as `vllm serve MODEL`; --model is the same (both: they must agree)
    p.add_argument("model_arg", nargs="?", metavar="MODEL", help="the model directory (or pass --model)")
    p.add_argument("--model", help="Hugging Face model directory (config.json, safetensors, tokenizer)")
    p.add_argument("--served-model-name", help="name clients pass as `model` (default: the directory's name)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | npu (optionally with :index)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory-mb", type=int, default=512)
    p.add_argument("--num-kv-blocks", type=int, help="overrides --kv-cache-memory-mb")
    p.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="reuse the KV blocks of a shared prompt prefix (per adapter); on by default",
    )
    p.add_argument("--max-model-len", type=int, help="default: the model's max_position_embeddings")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument(
        "--max-num-batched-tokens", type=int,
        help="tokens per step (default: 2048 with chunked prefill, else max(--max-model-len, 2048))",
    )
    p.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
        help="compute a long prompt a chunk per step beside the running decodes, so it does not stall them; "
        "on by default (--max-num-batched-tokens may then be below --max-model-len)",
    )
    p.add_argument(
        "--decode-stall-limit", type=float, default=1.25,
        help="while requests decode, a step that also computes chunks of a long prompt (see "
        "--long-prefill-token-threshold) may "
        "take at most this many times a step of the decodes alone, measured as the engine runs, so a long prompt "
        "does not hold up their next tokens; 0 lets chunks fill --max-num-batched-tokens, as vLLM (default 1.25)",
    )
    p.add_argument(
        "--long-prefill-token-threshold", type=int, default=LONG_PREFILL_TOKENS, metavar="TOKENS",
        help="a prompt of more tokens than this is long: while requests decode, its chunks are paced by "
        "--decode-stall-limit; shorter prompts are admitted whole. 0 paces every prompt: steadier inter-token "
        f"latency, later first tokens (default {LONG_PREFILL_TOKENS})",
    )
    p.add_argument(
        "--max-waiting-requests", type=int, default=1024,
        help="waiting sequences (a request counts prompts x n): a request of more gets 400, one that would "
        "overflow the queue now gets 503",
    )
    p.add_argument("--max-n", type=int, help="samples per prompt (default and upper bound: --max-num-seqs)")
    p.add_argument(
        "--max-request-tokens", type=int, metavar="TOKENS",
        help="tokens one request may ask for: its prompts x n sequences of prompt + max_tokens each; more gets "
        "400 (default: --max-num-seqs x --max-model-len)",
    )
    p.add_argument("--max-stop-strings", type=int, default=16, help="stop strings per request")
    p.add_argument("--max-stop-string-length", type=int, default=256, help="characters per stop string")
    p.add_argument(
        "--max-prompt-chars", type=int,
        help="longer prompts are refused before tokenizing (default: --max-model-len x 16)",
    )
    p.add_argument("--max-request-body-bytes", type=int, default=8 * 1024 * 1024)
    p.add_argument(
        "--num-threads", type=int,
        help="torch intra-op threads on CPU (default with the engine-core process: one per CPU, "
        "but one left to the API process from 4 CPUs up)",
    )
    p.add_argument(
        "--engine-core-process", action=argparse.BooleanOptionalAction, default=True,
        help="run the scheduler, model and step loop in their own process (on by default); "
        "--no-engine-core-process keeps them on a thread of the API process",
    )
    p.add_argument(
        "--omp-threads-bind", default=os.environ.get("LORAPLANE_CPU_OMP_THREADS_BIND", "auto"),
        help="CPUs of the engine-core process: auto (bind it to the last --num-threads CPUs when that leaves "
        "the API one), nobind, or a list such as 1-3 (default: $LORAPLANE_CPU_OMP_THREADS_BIND or auto)",
    )
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1,
        help="ranks to shard the model over (gloo on CPU, nccl on CUDA, hccl on NPU); also works under torchrun",
    )
    p.add_argument(
        "--lora-fused-row-allreduce", action="store_true",
        help="row-parallel LoRA adds each rank's partial delta before the base all-reduce (one all-reduce, not two)",
    )
    p.add_argument(
        "--admin-token",
        default=os.environ.get("LORAPLANE_ADMIN_TOKEN"),
        help="bearer token for the admin endpoints (default: $LORAPLANE_ADMIN_TOKEN)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("LORAPLANE_API_KEY"),
        help="bearer key required by the inference endpoints; /health and /metrics stay open "
        "(default: $LORAPLANE_API_KEY; prefer the variable: flags show in `ps`)",
    )
    lora = p.add_argument_group("multi-LoRA")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (chosen by `model`)")
    lora.add_argument("--max-loras", type=int, default=4, help="device slots: adapters resident at once")
    lora.add_argument(
        "--adapter-reader-process", action=argparse.BooleanOptionalAction, default=True,
        help="read and check adapter files in processes of their own (on by default: the first load starts one, "
        "and a second starts when two loads meet running requests), so that a load does not slow the "
        "streams being served; --no-adapter-reader-process reads them on threads of the API process")
    lora.add_argument("--max-lora-rank", type=int, default=64, help="largest adapter rank accepted")
    lora.add_argument("--lora-dtype", default="auto", choices=["auto", "bfloat16", "float16"],
                      help="dtype of the LoRA slots (auto: the model's); half-width slots of a float32 model halve the bytes read")
    lora.add_argument(
        "--max-cpu-loras", type=int, help="adapters kept validated in host memory (default: max(--max-loras, 16))"
    )
    lora.add_argument(
        "--lora-roots",
        nargs="+",
        action="extend",
        default=[],
        metavar="DIR",
        help="adapter paths must lie under one of these (repeatable; default: the --lora-modules folders' parents)",
    )
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help='adapters loaded at start: name=path or JSON {"name": ..., "path": ...} (repeatable)',
    )
    lora.add_argument(
        "--max-adapter-labels", type=int, default=100, help="distinct `adapter` metric labels before 'other'"
    )
    lora.add_argument(
        "--default-drain-timeout-s",
        type=float,
        default=30.0,
        help="how long an unload waits for in-flight requests before aborting them",
    )
    lora.add_argument(
        "--lora-cache-dir", metavar="DIR",
        help="where adapters fetched from the control plane by digest are kept (DIR/<digest>/), also across "
        "restarts; one engine per folder (default: a temporary folder of this process, removed at exit)",
    )
    lora.add_argument(
        "--lora-cache-max-bytes", type=int, default=8 << 30, metavar="N",
        help="bytes of fetched adapters kept; least recently used ones not in use are evicted (default: 8 GiB)",
    )
    lora.add_argument(
        "--lora-artifact-endpoint", metavar="URL", default=os.environ.get("LORAPLANE_ARTIFACT_ENDPOINT"),
        help="the artifact store's endpoint (e.g. S3): presigned file URLs are fetched from this origin too, "
        "besides the control plane's (default: $LORAPLANE_ARTIFACT_ENDPOINT)",
    )
    cp = p.add_argument_group("control plane")
    cp.add_argument("--control-plane", metavar="URL", help="register with this control plane, heartbeat, and "
                    "resolve unknown `model` names through it (needs --enable-lora)")
    cp.add_argument(
        "--control-plane-token",
        default=os.environ.get("LORAPLANE_CONTROL_PLANE_TOKEN"),
        help="this engine's token at the control plane, bound to its --engine-name there "
        "(LORAPLANE_ENGINE_CREDENTIALS); default: $LORAPLANE_CONTROL_PLANE_TOKEN, the way to pass it",
    )
    cp.add_argument("--engine-name", help="name to register under (default: host:port)")
    cp.add_argument("--heartbeat-interval-s", type=float, default=3.0,
                    help="seconds between heartbeats; keep it well under the control plane's "
                    "LORAPLANE_ENGINE_STALE_AFTER_S (default 30)")
    cp.add_argument(
        "--resolve-adapters", action=argparse.BooleanOptionalAction, default=None,
        help="load an unknown `model` on demand when the control plane knows it (default: on with --control-plane)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_log_format_argument(p)
    p.add_argument(
        "--shutdown-timeout-s", type=float, default=30.0,
        help="on SIGTERM: admit nothing new, drain at the control plane, let in-flight requests finish "
        "for up to this long, then stop",
    )
    return p


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    # imported here so `loraplane engine --help` stays fast
    from data_plane.config import EngineConfig

    return EngineConfig(
        model=model_from_args(args),
        served_model_name=args.served_model_name,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        block_size=args.block_size,
        kv_cache_memory_mb=args.kv_cache_memory_mb,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        decode_stall_limit=args.decode_stall_limit,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_waiting_requests=args.max_waiting_requests,
        max_n=args.max_n,
        max_request_tokens=args.max_request_tokens,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_length=args.max_stop_string_length,
        max_prompt_chars=args.max_prompt_chars,
        api_key=args.api_key,
        host=args.host,
        port=args.port,
        max_request_body_bytes=args.max_request_body_bytes,
        admin_token=args.admin_token,
        num_threads=args.num_threads,
        engine_core_process=args.engine_core_process,
        adapter_reader_process=args.adapter_reader_process,
        omp_threads_bind=args.omp_threads_bind,
        tensor_parallel_size=args.tensor_parallel_size,
        lora_fused_row_allreduce=args.lora_fused_row_allreduce,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        lora_dtype=args.lora_dtype,
        max_cpu_loras=args.max_cpu_loras,
        lora_roots=list(args.lora_roots),
        lora_modules=parse_lora_modules(args.lora_modules),
        max_adapter_labels=args.max_adapter_labels,
        default_drain_timeout_s=args.default_drain_timeout_s,
        lora_cache_dir=args.lora_cache_dir,
        lora_cache_max_bytes=args.lora_cache_max_bytes,
        lora_artifact_endpoint=args.lora_artifact_endpoint,
        control_plane_url=args.control_plane,
        control_plane_token=args.control_plane_token,
        engine_name=args.engine_name,
        heartbeat_interval_s=args.heartbeat_interval_s,
        resolve_adapters=args.resolve_adapters,
    )


def model_from_args(args: argparse.Namespace) -> str:
    """The positional MODEL or --model; one of them is required and, when both are given, they agree."""
    from data_plane.config import ConfigError

    if args.model_arg is not None and args.model is not None and args.model_arg != args.model:
        raise ConfigError(f"the model is given twice and differently: MODEL {args.model_arg!r} and "
                          f"--model {args.model!r}; pass one of them")
    model = args.model_arg if args.model is None else args.model
    if model is None:
        raise ConfigError("no model given: loraplane engine MODEL (or --model MODEL)")
    return model


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """vLLM's --lora-modules forms: `name=path`, or a JSON object with "name" and "path"."""
    from data_plane.config import ConfigError

    modules: dict[str, str] = {}
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                name, path = spec["name"], spec["path"]
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f'--lora-modules {item!r}: expected JSON {{"name": ..., "path": ...}}') from None
        else:
            name, sep, path = item.partition("=")
            if not sep:
                raise ConfigError(f"--lora-modules {item!r}: expected name=path")
        if not name or not path:
            raise ConfigError(f"--lora-modules {item!r}: name and path must not be empty")
        if name in modules:
            raise ConfigError(f"--lora-modules: {name!r} is given twice")
        modules[name] = path
    return modules


def load_engine(config: EngineConfig, core: CoreProcess | None) -> EngineProtocol:
    """The engine-core process `core` once it has loaded the model, or the engine on a thread here."""
    if core is None:
        from data_plane.engine.async_engine import AsyncLLMEngine

        return AsyncLLMEngine.from_config(config)
    from data_plane.engine.core.client import EngineCoreClient

    engine = EngineCoreClient.from_config(config, core)
    keep_api_off_the_core(config, engine)
    return engine


def keep_api_off_the_core(config: EngineConfig, engine: EngineCoreClient) -> None:
    """--omp-threads-bind auto bound the core to some CPUs: keep this process on the others."""
    from data_plane.engine.core.threads import api_cpus, bind_this_process
    from shared.cpus import available_cpus

    cpus = api_cpus(config.omp_threads_bind, engine.core.cpus, available_cpus())
    if cpus is not None:
        bind_this_process(cpus)
        logger.info("API process bound to CPUs %s", cpus)


def torchrun_rank() -> int:
    return int(os.environ.get("RANK", "0")) if "WORLD_SIZE" in os.environ else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    os.environ[LOG_FORMAT_ENV] = args.log_format  # tensor-parallel ranks are spawned with it
    try:
        config = config_from_args(args)
        if torchrun_rank() > 0:  # under torchrun every rank runs this command; only rank 0 serves
            from data_plane.engine.worker import worker_main

            worker_main(torchrun_rank(), config, "env://")
            return 0
        logger.info("loading %s", config.model)
        core = None
        if config.engine_core_process:
            from data_plane.engine.core.process import CoreProcess

            core = CoreProcess.spawn(config)  # it loads the model while this process imports the API
        import uvicorn

        from data_plane.api.app import create_app
        from data_plane.api.shutdown import AdmissionGate, DrainingServer, exit_through_python
        from data_plane.lora.shared_tensors import sweep_orphans

        for path in sweep_orphans():  # adapters' host copies left by engines that were killed outright
            logger.info("removed %s: its engine is gone", path)
        engine = load_engine(config, core)  # slow: reads the checkpoint, sizes the KV cache
        sock = listening_socket(config.host, config.port, inheritable=True)
    except (LoraplaneError, OSError) as exc:
        print(f"loraplane engine: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 2
    app = create_app(engine, config)
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    on_drain = None  # awaited on SIGTERM (data_plane/api/shutdown.py)
    if config.control_plane_url:
        from data_plane.control_client import attach_control_plane

        # a wildcard bind address is no address for others to call: advertise the host name instead
        advertised = f"http://{socket.gethostname()}:{port}" if host in ("0.0.0.0", "::") else url
        on_drain = attach_control_plane(app, engine, config, advertised, f"{socket.gethostname()}:{port}").drain
    print(f"loraplane engine: serving {config.served_model_name!r} on {url}", flush=True)
    gate = AdmissionGate(app)
    server = DrainingServer(
        # log_config=None: uvicorn's loggers keep the process's handler (shared/logging_setup.py)
        uvicorn.Config(
            gate, log_level=args.log_level, log_config=None, timeout_graceful_shutdown=5,
            access_log=args.log_level == "debug",
            # uvloop's event loop and httptools' C parser, as the router: a stream costs the API process an
            # ASGI send per token per request, and with the engine core in its own process that CPU is taken
            # from the core's torch threads on a small host (h11 framed each chunk in Python)
            loop="uvloop", http="httptools",
        ),
        gate, shutdown_timeout_s=args.shutdown_timeout_s, on_drain=on_drain,
    )
    exit_through_python()  # the signal uvicorn raises again once stopped, with the adapters' files removed
    server.run(sockets=[sock])
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
