"""EngineConfig: the one configuration object of an engine process, validated on construction.

Each field carries its flag, variable, default and help (shared/settings.py); `loraplane engine`'s parser
(api/server.py) is generated from them."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from shared.errors import InvalidRequestError
from shared.settings import (
    check_choices,
    host_setting,
    log_format_setting,
    log_level_setting,
    port_setting,
    setting,
    settings_repr,
)

# prompts of more tokens than this are long: while requests decode, only they are paced (engine/prefill_pacer.py)
LONG_PREFILL_TOKENS = 256

# A prompt of more characters than max_model_len * this cannot fit in the context, so it is refused
# before it is tokenized (tokenizing megabytes would take seconds). Real BPE vocabularies average
# 3-5 characters per token on text; their longest tokens are runs of spaces or repeated symbols of
# up to ~128 characters (code indentation, "=====" lines), but a prompt made only of those is
# pathological. 16 leaves a wide margin over real text and still bounds the work to a few MB at 128k.
PROMPT_CHARS_PER_TOKEN = 16


class ConfigError(InvalidRequestError, ValueError):
    """A flag combination the engine cannot run with."""


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """vLLM's --lora-modules forms: `name=path`, or a JSON object with "name" and "path"."""
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


MODEL, KV, SCHEDULING, LIMITS, PROCESSES = "model", "KV cache", "scheduling", "request limits", "processes and devices"
LORA, CONTROL, TOOLS = "multi-LoRA", "control plane", "tool calling"
# --tool-call-parser's formats: data_plane/api/tool_parsers (a test checks the two lists agree)
TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass
class EngineConfig:
    """The engine's flags (`loraplane engine --help` is generated from these fields: shared/settings.py)."""

    model: str = setting(flag="--model", group=MODEL, help="the Hugging Face model directory (config.json, "
                         "safetensors, tokenizer); or pass it as MODEL, the first argument, as `vllm serve MODEL`")
    served_model_name: str | None = setting(None, flag="--served-model-name", group=MODEL,
                                            help="the name clients pass as `model` (default: the directory's name)")
    tokenizer: str | None = setting(None, flag="--tokenizer", group=MODEL, help="tokenizer directory (default: --model)")
    dtype: str = setting("auto", flag="--dtype", group=MODEL, choices=("auto", "float32", "bfloat16", "float16"),
                         help="dtype of the weights and activations (auto: the checkpoint's, float32 if it says none)")
    device: str = setting("auto", flag="--device", group=MODEL,
                          help="auto | cpu | cuda | npu, optionally with :index (auto: cuda, else npu, else cpu)")
    seed: int = setting(0, flag="--seed", group=MODEL,
                        help="accepted as vLLM's --seed; a request's own `seed` field makes its sampling repeatable")
    block_size: int = setting(16, flag="--block-size", group=KV,
                              help="tokens per KV cache block: a power of two up to 128")
    kv_cache_memory_mb: int = setting(512, flag="--kv-cache-memory-mb", group=KV,
                                      help="memory for the K and V of all layers, in MiB")
    num_kv_blocks: int | None = setting(None, flag="--num-kv-blocks", group=KV,
                                        help="KV cache blocks; overrides --kv-cache-memory-mb (tests, tuning)")
    enable_prefix_caching: bool = setting(True, flag="--enable-prefix-caching", group=KV,
                                          help="reuse the KV blocks of a shared prompt prefix (per adapter)")
    max_model_len: int | None = setting(None, flag="--max-model-len", group=SCHEDULING,
                                        help="the longest context, prompt and output (default: the model's "
                                        "max_position_embeddings)")
    max_num_seqs: int = setting(128, flag="--max-num-seqs", group=SCHEDULING,
                                help="sequences running at once (a batch's rows)")
    max_num_batched_tokens: int | None = setting(
        None, flag="--max-num-batched-tokens", group=SCHEDULING,
        help="tokens per step (default: 2048 with chunked prefill, else max(--max-model-len, 2048))")
    enable_chunked_prefill: bool = setting(
        True, flag="--enable-chunked-prefill", group=SCHEDULING,
        help="compute a long prompt a chunk per step beside the running decodes, so it does not stall them "
        "(--max-num-batched-tokens may then be below --max-model-len)")
    decode_stall_limit: float = setting(
        1.25, flag="--decode-stall-limit", group=SCHEDULING,
        help="while requests decode, a step that also computes chunks of a long prompt (see "
        "--long-prefill-token-threshold) may take at most this many times a step of the decodes alone, measured as "
        "the engine runs, so a long prompt does not hold up their next tokens; more while many long prompts wait "
        "for each decode: 1 + prompts / decodes (engine/prefill_pacer.py); 0 lets "
        "chunks fill --max-num-batched-tokens, as vLLM")
    long_prefill_token_threshold: int = setting(
        LONG_PREFILL_TOKENS, flag="--long-prefill-token-threshold", group=SCHEDULING, metavar="TOKENS",
        help="a prompt of more tokens than this is long: while requests decode, its chunks are paced by "
        "--decode-stall-limit; shorter prompts are admitted whole. 0 paces every prompt: steadier inter-token "
        "latency, later first tokens")
    max_waiting_requests: int = setting(
        1024, flag="--max-waiting-requests", group=LIMITS,
        help="waiting sequences (a request counts prompts x n): a request of more gets 400, one that would "
        "overflow the queue now gets 503 (engine/admission.py)")
    max_n: int | None = setting(None, flag="--max-n", group=LIMITS,
                                help="samples per prompt (default and upper bound: the smaller of --max-num-seqs and "
                                "--max-waiting-requests)")
    max_request_tokens: int | None = setting(
        None, flag="--max-request-tokens", group=LIMITS, metavar="TOKENS",
        help="tokens one request may ask for: its prompts x n sequences of prompt + max_tokens each; more gets "
        "400 (default: --max-num-seqs x --max-model-len, a full batch of full contexts)")
    max_stop_strings: int = setting(16, flag="--max-stop-strings", group=LIMITS, help="stop strings per request")
    max_stop_string_length: int = setting(256, flag="--max-stop-string-length", group=LIMITS,
                                          help="characters per stop string")
    max_prompt_chars: int | None = setting(
        None, flag="--max-prompt-chars", group=LIMITS,
        help=f"longer prompts are refused before tokenizing (default: --max-model-len x {PROMPT_CHARS_PER_TOKEN})")
    max_structured_output_bytes: int = setting(
        64 * 1024, flag="--max-structured-output-bytes", group=LIMITS, default_text="64 KiB",
        help="bytes of a structured output's constraint (JSON schema, regex, choices, grammar); more gets 400")
    structured_output_compile_timeout: float = setting(
        10.0, flag="--structured-output-compile-timeout", group=LIMITS, metavar="SECONDS",
        help="a request waits this long for its structured output's constraint to compile; longer gets 400")
    structured_output_cache_size: int = setting(
        256, flag="--structured-output-cache-size", group=LIMITS, metavar="GRAMMARS",
        help="compiled structured-output constraints kept (least recently used dropped first), in the API "
        "process and in the engine core")
    host: str = host_setting()
    port: int = port_setting(8000)
    max_request_body_bytes: int = setting(8 * 1024 * 1024, flag="--max-request-body-bytes", group="HTTP",
                                          default_text="8 MiB", help="larger request bodies are answered 413")
    admin_token: str | None = setting(None, flag="--admin-token", env="LORAPLANE_ADMIN_TOKEN", secret=True,
                                      group="HTTP", help="bearer token of the admin endpoints (loading and "
                                      "unloading adapters, draining); unset, they are refused")
    read_token: str | None = setting(None, flag="--read-token", env="LORAPLANE_READ_TOKEN", secret=True,
                                     group="HTTP", help="bearer token that may read the listings (/v1/lora_adapters, "
                                     "/v1/lora_stats, /v1/models) and nothing else; with this or --admin-token set, "
                                     "they need one of the two (/v1/models also takes --api-key); with neither, "
                                     "they are open")
    api_key: str | None = setting(None, flag="--api-key", env="LORAPLANE_API_KEY", secret=True, group="HTTP",
                                  help="bearer key required by the inference endpoints, as vLLM's --api-key; "
                                  "/health and /metrics stay open; unset, the engine is open")
    num_threads: int | None = setting(
        None, flag="--num-threads", group=PROCESSES,
        help="torch intra-op threads on CPU (default with the engine-core process: one per CPU, "
        "but one left to the API process from 4 CPUs up; without it, torch's default)")
    engine_core_process: bool = setting(
        True, flag="--engine-core-process", group=PROCESSES,
        help="run the scheduler, model and step loop in their own process (data_plane/engine/core); "
        "--no-engine-core-process keeps them on a thread of the API process")
    omp_threads_bind: str = setting(
        "auto", flag="--omp-threads-bind", env="LORAPLANE_CPU_OMP_THREADS_BIND", group=PROCESSES,
        help="CPUs of the engine-core process: auto (bind it to the last --num-threads CPUs when that leaves "
        "the API one), nobind, or a list such as 1-3")
    tensor_parallel_size: int = setting(
        1, flag="--tensor-parallel-size", group=PROCESSES,
        help="ranks to shard the model over (gloo on CPU, nccl on CUDA, hccl on NPU); also works under torchrun")
    lora_fused_row_allreduce: bool = setting(
        False, flag="--lora-fused-row-allreduce", group=PROCESSES,
        help="row-parallel LoRA adds each rank's partial delta before the base all-reduce (one all-reduce per "
        "layer, not two)")
    enable_lora: bool = setting(False, flag="--enable-lora", group=LORA,
                                help="serve LoRA adapters (chosen by the request's `model`)")
    adapter_reader_process: bool = setting(
        True, flag="--adapter-reader-process", group=LORA,
        help="read and check adapter files in processes of their own (the first load starts one, and a second "
        "starts when two loads meet running requests), so that a load does not slow the streams being served; "
        "--no-adapter-reader-process reads them on threads of the API process, sharing its GIL")
    max_loras: int = setting(4, flag="--max-loras", group=LORA,
                             help="device slots: adapters resident for compute at once")
    max_lora_rank: int = setting(64, flag="--max-lora-rank", group=LORA,
                                 help="largest adapter rank accepted; slots are padded to it")
    lora_dtype: str = setting("auto", flag="--lora-dtype", group=LORA, choices=("auto", "bfloat16", "float16"),
                              help="dtype of the LoRA slots (auto: the model's); half-width slots of a float32 "
                              "model halve the bytes read (their sums stay float32)")
    max_cpu_loras: int | None = setting(None, flag="--max-cpu-loras", group=LORA,
                                        help="adapters kept validated in host memory (default: max(--max-loras, 16))")
    lora_roots: list[str] = setting(default_factory=list, flag="--lora-roots", group=LORA, metavar="DIR",
                                    help="adapter paths must lie under one of these (default: the --lora-modules "
                                    "folders' parents)")
    lora_modules: dict[str, str] = setting(
        default_factory=dict, flag="--lora-modules", group=LORA, metavar="NAME=PATH", parse=parse_lora_modules,
        help='adapters loaded at start: name=path or JSON {"name": ..., "path": ...}')
    max_adapter_labels: int = setting(100, flag="--max-adapter-labels", group=LORA,
                                      help="distinct `adapter` label values of the Prometheus metrics; past "
                                      "these, adapters are counted as 'other'")
    default_drain_timeout_s: float = setting(30.0, flag="--default-drain-timeout-s", group=LORA,
                                             help="how long an unload waits for in-flight requests before "
                                             "aborting them")
    lora_cache_dir: str | None = setting(
        None, flag="--lora-cache-dir", group=LORA, metavar="DIR",
        help="where adapters fetched from the control plane by digest are kept (DIR/<digest>/), also across "
        "restarts; one engine per folder (default: a temporary folder of this process, removed at exit)")
    lora_cache_max_bytes: int = setting(
        8 << 30, flag="--lora-cache-max-bytes", group=LORA, metavar="N", default_text="8 GiB",
        help="bytes of fetched adapters kept; least recently used ones not in use are evicted")
    lora_artifact_endpoint: str | None = setting(
        None, flag="--lora-artifact-endpoint", env="LORAPLANE_ARTIFACT_ENDPOINT", group=LORA, metavar="URL",
        help="the artifact store's endpoint (e.g. S3): presigned file URLs are fetched from this origin too, "
        "besides the control plane's")
    control_plane_url: str | None = setting(
        None, flag="--control-plane", group=CONTROL, metavar="URL",
        help="register with this control plane, heartbeat, and resolve unknown `model` names through it "
        "(needs --enable-lora)")
    control_plane_token: str | None = setting(
        None, flag="--control-plane-token", env="LORAPLANE_CONTROL_PLANE_TOKEN", secret=True, group=CONTROL,
        help="this engine's token at the control plane, bound to its --engine-name there (its "
        "LORAPLANE_ENGINE_CREDENTIALS entry)")
    engine_name: str | None = setting(None, flag="--engine-name", group=CONTROL,
                                      help="the name to register under (default: host:port)")
    heartbeat_interval_s: float = setting(
        3.0, flag="--heartbeat-interval-s", group=CONTROL,
        help="seconds between heartbeats; keep it well under the control plane's LORAPLANE_ENGINE_STALE_AFTER_S "
        "(30 by default), or the engine reads as unhealthy between two of them")
    resolve_adapters: bool | None = setting(
        None, flag="--resolve-adapters", group=CONTROL,
        help="load an unknown `model` on demand when the control plane knows it (default: on with --control-plane)")
    shutdown_timeout_s: float = setting(
        30.0, flag="--shutdown-timeout-s", group="HTTP",
        help="on SIGTERM: admit nothing new, drain at the control plane, let in-flight requests finish "
        "for up to this long, then stop")
    enable_auto_tool_choice: bool = setting(
        False, flag="--enable-auto-tool-choice", group=TOOLS,
        help='read the calls the model writes itself (tool_choice "auto", the default when a request has tools) '
        "with --tool-call-parser; off, such requests get 400, as vLLM's ('required' and named tool choices "
        "work either way: the output is constrained to the calls)")
    tool_call_parser: str | None = setting(
        None, flag="--tool-call-parser", group=TOOLS, choices=TOOL_CALL_PARSERS,
        help="how calls are written in the model's output: hermes (<tool_call>{json}</tool_call>, Qwen2.5 and "
        'Qwen3, Hermes) or llama3_json ({"name": ..., "parameters": ...}, Llama 3.1+)')
    log_level: str = log_level_setting()
    log_format: str = log_format_setting()

    __repr__ = settings_repr  # the tokens hidden

    def __post_init__(self) -> None:
        if not Path(self.model, "config.json").is_file():
            raise ConfigError(f"--model {self.model!r} is not a model directory: config.json not found there")
        if self.served_model_name is None:
            self.served_model_name = Path(self.model).resolve().name
        if self.tokenizer is None:
            self.tokenizer = self.model
        check_choices(self, ConfigError)
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ConfigError(f"--block-size {self.block_size}: expected a power of two up to 128")
        if self.max_num_seqs < 1:
            raise ConfigError("--max-num-seqs must be at least 1")
        if self.tensor_parallel_size < 1:
            raise ConfigError("--tensor-parallel-size must be at least 1")
        if self.max_waiting_requests < 1:
            raise ConfigError("--max-waiting-requests must be at least 1")
        # one request's samples must fit in a batch and in the waiting queue, or it could never run
        n_cap = min(self.max_num_seqs, self.max_waiting_requests)
        if self.max_n is None:
            self.max_n = n_cap
        if not 1 <= self.max_n <= n_cap:
            raise ConfigError(f"--max-n must be between 1 and min(--max-num-seqs, --max-waiting-requests) = {n_cap}")
        if self.max_stop_strings < 0 or self.max_stop_string_length < 1:
            raise ConfigError("--max-stop-strings must be at least 0 and --max-stop-string-length at least 1")
        if self.max_structured_output_bytes < 1 or self.structured_output_cache_size < 1:
            raise ConfigError("--max-structured-output-bytes and --structured-output-cache-size must be at least 1")
        if not self.structured_output_compile_timeout > 0:
            raise ConfigError("--structured-output-compile-timeout must be positive")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ConfigError("--max-prompt-chars must be at least 1")
        if self.max_request_tokens is not None and self.max_request_tokens < 1:
            raise ConfigError("--max-request-tokens must be at least 1")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = max(self.max_loras, 16)
        if self.enable_lora:
            if self.max_loras < 1 or self.max_lora_rank < 1:
                raise ConfigError("--max-loras and --max-lora-rank must be at least 1")
            if self.max_cpu_loras < self.max_loras:
                raise ConfigError("--max-cpu-loras must be at least --max-loras")
            if not self.lora_roots and self.lora_modules:
                # preloaded adapters name their own directories: allow exactly those
                self.lora_roots = [str(Path(p).resolve().parent) for p in self.lora_modules.values()]
        elif self.lora_modules:
            raise ConfigError("--lora-modules needs --enable-lora")
        if self.lora_cache_max_bytes < 1:
            raise ConfigError("--lora-cache-max-bytes must be at least 1")
        if self.lora_artifact_endpoint is not None and not self.lora_artifact_endpoint.startswith(
                ("http://", "https://")):
            raise ConfigError(f"--lora-artifact-endpoint {self.lora_artifact_endpoint!r}: expected an http(s):// URL")
        if not 0 < self.heartbeat_interval_s <= 3600:
            raise ConfigError(f"--heartbeat-interval-s must be in (0, 3600], got {self.heartbeat_interval_s}")
        if self.control_plane_url is not None:
            if not self.control_plane_url.startswith(("http://", "https://")):
                raise ConfigError(f"--control-plane {self.control_plane_url!r}: expected an http(s):// URL")
            if not self.enable_lora:
                raise ConfigError("--control-plane needs --enable-lora (the control plane places adapters)")
            self.control_plane_url = self.control_plane_url.rstrip("/")
        if self.resolve_adapters is None:
            self.resolve_adapters = self.control_plane_url is not None
        elif self.resolve_adapters and self.control_plane_url is None:
            raise ConfigError("--resolve-adapters needs --control-plane (that is where names are resolved)")
        if self.omp_threads_bind not in ("auto", "nobind") and not re.fullmatch(
                r"\d+(-\d+)?(,\d+(-\d+)?)*", self.omp_threads_bind):
            raise ConfigError(f"--omp-threads-bind {self.omp_threads_bind!r}: expected auto, nobind or a CPU list like 1-3")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(f"--long-prefill-token-threshold {self.long_prefill_token_threshold}: expected 0 or more")
        if self.decode_stall_limit != 0 and self.decode_stall_limit <= 1:
            raise ConfigError(f"--decode-stall-limit {self.decode_stall_limit}: expected 0 (off) or a factor above 1, "
                              "such as 1.25")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ConfigError("--num-kv-blocks must be at least 2")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice requires --tool-call-parser")

    def finalize(self, model_max_len: int) -> None:
        """Fill the defaults that depend on the loaded model; check the scheduling limits fit together."""
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if self.enable_chunked_prefill else max(self.max_model_len, 2048)
        if self.max_prompt_chars is None:
            self.max_prompt_chars = self.max_model_len * PROMPT_CHARS_PER_TOKEN
        if self.max_request_tokens is None:
            self.max_request_tokens = self.max_num_seqs * self.max_model_len
        if self.enable_chunked_prefill:
            # every running sequence decodes one token per step, within the budget
            if self.max_num_batched_tokens < self.max_num_seqs:
                raise ConfigError(
                    f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least "
                    f"--max-num-seqs ({self.max_num_seqs})"
                )
        elif self.max_num_batched_tokens < self.max_model_len:
            # no chunked prefill: a whole prompt must fit in one step
            raise ConfigError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least "
                f"--max-model-len ({self.max_model_len}) without chunked prefill; lower --max-model-len, raise the "
                "token budget or leave --enable-chunked-prefill on"
            )
