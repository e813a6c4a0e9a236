"""`loraplane router`: the OpenAI endpoint in front of the engines, routing by adapter residency.

    loraplane router --control-plane URL [--host 127.0.0.1] [--port 8000] [--log-format text|json]

Secrets come from the environment, or from a file named by the same variable with `_FILE` appended
(never from flags, which every user sees in `ps`): LORAPLANE_ROUTER_TOKEN (this router's token at the
control plane: one of its LORAPLANE_ROUTER_TOKENS), LORAPLANE_ENGINE_API_KEY (the engines' --api-key),
LORAPLANE_API_KEYS (comma-separated keys clients must send; unset, the router is open), LORAPLANE_REDIS_URL
(tenants' quota counters and key revocations, with --require-api-key), LORAPLANE_KEY_PEPPER (the control
plane's, to verify tenant keys; without it only keys hashed before the pepper existed are verified).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from data_plane.router.config import MAX_REQUEST_TOKENS_ENV, RouterConfig, RouterConfigError, secrets_from_env
from shared.listen import listening_socket
from shared.logging_setup import add_log_format_argument, configure_logging

logger = logging.getLogger("loraplane.router")


def _parser() -> argparse.ArgumentParser:
    d = RouterConfig.__dataclass_fields__
    p = argparse.ArgumentParser(prog="loraplane router", description=__doc__.split("\n\n")[0])
    p.add_argument("--control-plane", required=True, metavar="URL", help="the control plane's base URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    p.add_argument("--refresh-interval-s", type=float, default=d["refresh_interval_s"].default,
                   help="how often the routing table is revalidated (If-None-Match)")
    p.add_argument("--demand-interval-s", type=float, default=d["demand_interval_s"].default,
                   help="how often per-model queue figures are reported to the control plane")
    p.add_argument("--router-name", default="", help="how the control plane lists this router (default host:port)")
    p.add_argument("--advertise-url", help="where clients reach this router, as the console shows it "
                   "(default http://HOST:PORT)")
    p.add_argument("--stale-after-s", type=float, default=d["stale_after_s"].default,
                   help="/health says degraded once the table has not been confirmed for this long")
    p.add_argument("--max-attempts", type=int, default=d["max_attempts"].default,
                   help="engines tried per request before the first byte (connect refused, 503)")
    p.add_argument("--connect-timeout-s", type=float, default=d["connect_timeout_s"].default)
    p.add_argument("--read-timeout-s", type=float, default=d["read_timeout_s"].default,
                   help="longest wait for an engine's next bytes")
    p.add_argument("--max-request-body-bytes", type=int, default=d["max_request_body_bytes"].default)
    p.add_argument("--max-request-tokens", type=int,
                   default=os.environ.get(MAX_REQUEST_TOKENS_ENV, d["max_request_tokens"].default),
                   help="the most tokens one request may reserve (its prompts, plus max_tokens for each sample "
                   "of each prompt, or the context left without max_tokens); larger ones are answered 400 "
                   f"(default: ${MAX_REQUEST_TOKENS_ENV}, else no ceiling)")
    p.add_argument("--require-api-key", action="store_true",
                   help="every client sends a key: a static one (LORAPLANE_API_KEYS) or a tenant key, whose "
                   "adapters and quotas the control plane keeps (quotas counted in Redis: LORAPLANE_REDIS_URL)")
    p.add_argument("--redis-prefix", default=d["redis_prefix"].default,
                   help="of every Redis key and channel (the control plane's LORAPLANE_REDIS_PREFIX)")
    p.add_argument("--quota-failure", choices=["closed", "open"], default=d["quota_failure"].default,
                   help="Redis unreachable: refuse requests with quotas (503) or admit them uncounted")
    p.add_argument("--key-cache-ttl-s", type=float, default=d["key_cache_ttl_s"].default,
                   help="a verified tenant key is checked with the control plane again after this long "
                   "(the bound on a revocation Redis did not carry)")
    p.add_argument("--key-failures-per-address", type=int, default=d["key_failures_per_address"].default,
                   help="failed tenant-key attempts from one client address within --key-failure-window-s, after "
                   "which its attempts are answered 429 without a hash")
    p.add_argument("--key-failures-per-key", type=int, default=d["key_failures_per_key"].default,
                   help="failed attempts of one key id (from any addresses) after which its offers are answered 429, "
                   "but for the secret already verified (its holder keeps working)")
    p.add_argument("--key-failure-window-s", type=float, default=d["key_failure_window_s"].default,
                   help="the window over which failed tenant-key attempts are counted")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_log_format_argument(p)
    return p


def name_after_bind(config: RouterConfig, port: int) -> None:
    """The defaults that need the bound port (`--port 0`): the router's name and advertised URL."""
    shown = socket.gethostname() if config.host in ("0.0.0.0", "::", "") else config.host
    shown = f"[{shown}]" if ":" in shown else shown
    config.name = config.name or f"{shown}:{port}"
    config.advertise_url = config.advertise_url or f"http://{shown}:{port}"


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    if args.log_level != "debug":  # a line per proxied request and per demand report is no news at INFO
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = RouterConfig(
            control_plane_url=args.control_plane, host=args.host, port=args.port,
            refresh_interval_s=args.refresh_interval_s, demand_interval_s=args.demand_interval_s,
            stale_after_s=args.stale_after_s, max_attempts=args.max_attempts,
            connect_timeout_s=args.connect_timeout_s, read_timeout_s=args.read_timeout_s,
            max_request_body_bytes=args.max_request_body_bytes, max_request_tokens=args.max_request_tokens,
            log_level=args.log_level, log_format=args.log_format, name=args.router_name,
            advertise_url=args.advertise_url,
            require_api_key=args.require_api_key, redis_prefix=args.redis_prefix,
            quota_failure=args.quota_failure, key_cache_ttl_s=args.key_cache_ttl_s,
            key_failures_per_address=args.key_failures_per_address, key_failures_per_key=args.key_failures_per_key,
            key_failure_window_s=args.key_failure_window_s,
            **secrets_from_env(),  # type: ignore[arg-type]
        )
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
    server = uvicorn.Server(uvicorn.Config(app, loop="uvloop", http="httptools", log_level=args.log_level,
                                           log_config=None, access_log=args.log_level == "debug",
                                           timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
