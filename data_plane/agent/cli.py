"""`loraplane agent`: the sidecar that makes an engine of another kind (vLLM) an engine of the fleet.

    loraplane agent --engine-kind vllm --engine-url http://127.0.0.1:8000 \
        --control-plane http://cp:8080 --engine-name gpu-0 --adapter-dir /var/lib/loraplane/adapters

Flags and variables are AgentConfig's fields (config.py); secrets come from the environment or a file
(LORAPLANE_ADMIN_TOKEN, LORAPLANE_CONTROL_PLANE_TOKEN, LORAPLANE_ENGINE_API_KEY), never from flags.
--engine-url must pass the engine-URL rules of registration (shared.engine_urls): it is registered as
the engine's inference URL. Torch-free: it runs in the base install.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys

from data_plane.agent.config import AgentConfig, AgentConfigError
from shared.engine_urls import check_engine_url
from shared.errors import LoraplaneError
from shared.listen import listening_socket
from shared.logging_setup import configure_logging
from shared.settings import SettingsParser, deprecations, from_args

logger = logging.getLogger("loraplane.agent")


def _parser() -> SettingsParser:
    return SettingsParser(AgentConfig, prog="loraplane agent", description=__doc__.split("\n\n")[0])


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format, process="agent")
    if args.log_level != "debug":
        logging.getLogger("httpx").setLevel(logging.WARNING)
    for deprecation in deprecations(args):
        logger.warning("%s", deprecation)
    try:
        config = from_args(AgentConfig, args)
        config.engine_url = asyncio.run(check_engine_url(config.engine_url, ()))
        sock = listening_socket(config.host, config.port)
    except LoraplaneError as exc:
        print(f"loraplane agent: --engine-url: {exc.message}", file=sys.stderr)
        return 2
    except (AgentConfigError, OSError) as exc:
        print(f"loraplane agent: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from data_plane.agent.app import create_app
    from data_plane.agent.runtime import AgentRuntime

    host, port = sock.getsockname()[:2]
    shown = socket.gethostname() if host in ("0.0.0.0", "::") else (f"[{host}]" if ":" in host else host)
    admin_url = f"http://{shown}:{port}"  # what the control plane calls: a wildcard address is none
    agent = AgentRuntime(config, admin_url, f"{shown}:{port}")
    print(f"loraplane agent: serving the admin API of {config.engine_kind} at {config.engine_url} on {admin_url}",
          flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(agent), loop="uvloop", http="httptools",
                                           log_level=config.log_level, log_config=None,
                                           access_log=config.log_level == "debug", timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
