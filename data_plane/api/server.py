"""`loraplane engine`: parse flags into an EngineConfig (the parser is generated from its fields), load the model,
serve the API with uvicorn.

This is the only place that reads the command line or the environment for an engine process.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING

from data_plane.config import ConfigError, EngineConfig
from shared.errors import LoraplaneError
from shared.listen import listening_socket
from shared.logging_setup import LOG_FORMAT_ENV, LOG_PROCESS_ENV, configure_logging
from shared.settings import SettingsParser, deprecations, from_args

if TYPE_CHECKING:
    from data_plane.engine.core.client import EngineCoreClient
    from data_plane.engine.core.process import CoreProcess
    from data_plane.engine.protocol import EngineProtocol

logger = logging.getLogger("loraplane.engine")


def build_parser() -> SettingsParser:
    """EngineConfig's flags (shared/settings.py), and MODEL: `loraplane engine MODEL`, as `vllm serve MODEL`."""
    p = SettingsParser(EngineConfig, prog="loraplane engine", description="Serve a model over an OpenAI-compatible API.",
                       usage="%(prog)s [MODEL | --model MODEL] [options]")
    p.add_argument("model_arg", nargs="?", metavar="MODEL", help="the model directory (or pass --model; both: they "
                   "must agree)")
    return p


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    config: EngineConfig = from_args(EngineConfig, args, model=model_from_args(args))
    return config


def model_from_args(args: argparse.Namespace) -> str:
    """The positional MODEL or --model; one of them is required and, when both are given, they agree."""
    if args.model_arg is not None and args.model is not None and args.model_arg != args.model:
        raise ConfigError(f"the model is given twice and differently: MODEL {args.model_arg!r} and "
                          f"--model {args.model!r}; pass one of them")
    model: str | None = args.model_arg if args.model is None else args.model
    if model is None:
        raise ConfigError("no model given: loraplane engine MODEL (or --model MODEL)")
    return model


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
    process = f"engine[{args.engine_name}]" if getattr(args, "engine_name", None) else "engine"
    configure_logging(args.log_level, args.log_format, process=process)
    # the engine-core process and tensor-parallel ranks are spawned with them
    os.environ[LOG_FORMAT_ENV], os.environ[LOG_PROCESS_ENV] = args.log_format, process
    for deprecation in deprecations(args):
        logger.warning("%s", deprecation)
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

        from data_plane.adapters.loading.shared_tensors import sweep_orphans
        from data_plane.api.app import create_app
        from data_plane.api.shutdown import AdmissionGate, DrainingServer, exit_through_python

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
        from data_plane.api.control_plane import attach_control_plane

        # a wildcard bind address is no address for others to call: advertise the host name instead
        advertised = f"http://{socket.gethostname()}:{port}" if host in ("0.0.0.0", "::") else url
        on_drain = attach_control_plane(app, engine, config, advertised, f"{socket.gethostname()}:{port}").drain
    print(f"loraplane engine: serving {config.served_model_name!r} on {url}", flush=True)
    gate = AdmissionGate(app)
    server = DrainingServer(
        # log_config=None: uvicorn's loggers keep the process's handler (shared/logging_setup.py)
        uvicorn.Config(
            gate, log_level=config.log_level, log_config=None, timeout_graceful_shutdown=5,
            access_log=config.log_level == "debug",
            # uvloop's event loop and httptools' C parser, as the router: a stream costs the API process an
            # ASGI send per token per request, and with the engine core in its own process that CPU is taken
            # from the core's torch threads on a small host (h11 framed each chunk in Python)
            loop="uvloop", http="httptools",
        ),
        gate, shutdown_timeout_s=config.shutdown_timeout_s, on_drain=on_drain,
    )
    exit_through_python()  # the signal uvicorn raises again once stopped, with the adapters' files removed
    server.run(sockets=[sock])
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
