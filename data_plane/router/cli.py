"""`loraplane router`: the OpenAI endpoint in front of the engines, routing by adapter residency.

    loraplane router --control-plane URL [--host 127.0.0.1] [--port 8000] [--log-format text|json]

Flags and variables are RouterConfig's fields (config.py). Secrets come from the environment, or from a
file named by the same variable with `_FILE` appended (never from flags, which every user sees in `ps`):
LORAPLANE_ROUTER_TOKEN, LORAPLANE_ENGINE_API_KEY, LORAPLANE_API_KEYS, LORAPLANE_REDIS_URL and
LORAPLANE_KEY_PEPPER, which `--help` describes after the options.
"""

from __future__ import annotations

import logging
import socket
import sys

from data_plane.router.config import RouterConfig, RouterConfigError
from shared.listen import listening_socket
from shared.logging_setup import configure_logging
from shared.settings import SettingsParser, deprecations, from_args

logger = logging.getLogger("loraplane.router")


def _parser() -> SettingsParser:
    """RouterConfig's flags (shared/settings.py); parsing also reads the secrets from the environment."""
    return SettingsParser(RouterConfig, prog="loraplane router", description=__doc__.split("\n\n")[0])


def name_after_bind(config: RouterConfig, port: int) -> None:
    """The defaults that need the bound port (`--port 0`): the router's name and advertised URL."""
    shown = socket.gethostname() if config.host in ("0.0.0.0", "::", "") else config.host
    shown = f"[{shown}]" if ":" in shown else shown
    config.name = config.name or f"{shown}:{port}"
    config.advertise_url = config.advertise_url or f"http://{shown}:{port}"


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format, process="router")
    if args.log_level != "debug":  # a line per proxied request and per demand report is no news at INFO
        logging.getLogger("httpx").setLevel(logging.WARNING)
    for deprecation in deprecations(args):
        logger.warning("%s", deprecation)
    try:
        config = from_args(RouterConfig, args)
        sock = listening_socket(config.host, config.port)
        name_after_bind(config, sock.getsockname()[1])
    except (RouterConfigError, OSError) as exc:
        print(f"loraplane router: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from .app import create_app

    app = create_app(config)
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    keys = f"{len(config.api_keys)} client key(s)" if config.api_keys else "open (no LORAPLANE_API_KEYS)"
    if config.require_api_key:
        quotas = "quotas in Redis" if config.redis_url else "no LORAPLANE_REDIS_URL: quotas fail " + config.quota_failure
        pepper = "" if config.key_pepper else (", no LORAPLANE_KEY_PEPPER: only tenant keys hashed before it existed "
                                               "are verified, others are answered 503")
        keys = f"API keys required (tenant keys, {len(config.api_keys)} static), {quotas}{pepper}"
    print(f"loraplane router: serving on {url}, routes from {config.control_plane_url}, {keys}", flush=True)
    # uvloop's event loop and httptools' C parser: the router's own cost is per request and per chunk, and
    # uvicorn's pure-Python h11 parser and asyncio's loop were most of it (base dependencies, so never absent)
    server = uvicorn.Server(uvicorn.Config(app, loop="uvloop", http="httptools", log_level=config.log_level,
                                           log_config=None, access_log=config.log_level == "debug",
                                           timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
