"""`loraplane control`: run the control plane, or manage its database schema.

    loraplane control [--host H] [--port P] [--database-url URL] [--lora-roots DIR ...] [--log-format text|json]
                      [--default-min-replicas N] [--default-max-replicas N|all]
    loraplane control db upgrade [REVISION] | downgrade REVISION | current

Tokens come only from the environment (a flag would leave them in the process list and shell history):
LORAPLANE_ADMIN_TOKENS, LORAPLANE_READ_TOKENS (comma-separated); LORAPLANE_ENGINE_CREDENTIALS
(`name=token,…`: each engine's own token, good for its name's register/heartbeat/resolve/drain only);
LORAPLANE_ENGINE_ADMIN_TOKEN (old name LORAPLANE_ENGINE_TOKEN: the engines' --admin-token, sent on
pushes). LORAPLANE_ENGINE_ALLOWED_NETWORKS (CIDR, comma-separated): engine URLs must lie in them.
LORAPLANE_ENGINE_TIMEOUT_S (10): total deadline of one engine call. LORAPLANE_ENGINE_STALE_AFTER_S (30):
heartbeats missed for this long make an engine unhealthy.

Replicas: each adapter is held by --default-min-replicas (1) to --default-max-replicas (3, or `all`)
engines unless it sets its own `replicas`; demand scaling moves between them
(LORAPLANE_SCALE_UP_LOAD_PER_REPLICA 8, LORAPLANE_SCALE_WINDOW_S 30, LORAPLANE_SCALE_DOWN_IDLE_S 300), and
rebalancing moves at most LORAPLANE_REBALANCE_MAX_MOVES (4) placements per reconcile interval.

Adapter roots are spelled as on the engine: --lora-roots DIR… (LORAPLANE_LORA_ROOTS); the old
--adapter-root DIR (LORAPLANE_ADAPTER_ROOTS) still works and warns that it is deprecated.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import warnings

from control_plane.settings import ControlPlaneSettings, parse_max_replicas
from shared.logging_setup import add_log_format_argument, configure_logging

# On SIGTERM, connections still open this long after the server stopped accepting are closed: a slow
# artifact download or a client that keeps its connection must not hold the shutdown past a process
# manager's kill (an engine whose fetch is cut retries it on the next reconcile pass)
GRACEFUL_SHUTDOWN_S = 10

logger = logging.getLogger("loraplane.control")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loraplane control", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", help="bind address (LORAPLANE_HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (LORAPLANE_PORT; default 8080)")
    p.add_argument("--database-url", help="sqlite+aiosqlite:///… or postgresql+asyncpg://… (LORAPLANE_DATABASE_URL)")
    p.add_argument("--lora-roots", nargs="+", action="extend", metavar="DIR",
                   help="directories adapters may be registered from; repeatable (LORAPLANE_LORA_ROOTS, "
                   "the OS path separator or commas between them)")
    p.add_argument("--adapter-root", action="append", metavar="DIR",
                   help="deprecated: the old name of --lora-roots (one directory per flag)")
    p.add_argument("--reconcile-interval-s", type=float, help="LORAPLANE_RECONCILE_INTERVAL_S")
    p.add_argument("--artifact-store", metavar="URL",
                   help="where versions' bytes are kept: file:///path or s3://bucket/prefix (AWS_* variables "
                   "for credentials, region, AWS_ENDPOINT_URL); LORAPLANE_ARTIFACT_STORE, default "
                   "file://$PWD/.loraplane/artifacts")
    p.add_argument("--max-artifact-bytes", type=int, metavar="N",
                   help="largest version a load or upload may bring in, all files together (413 above it); "
                   "LORAPLANE_MAX_ARTIFACT_BYTES, default 4 GiB")
    p.add_argument("--public-url", metavar="URL",
                   help="how engines reach this control plane, for absolute artifact URLs (LORAPLANE_PUBLIC_URL); "
                   "unset, engines resolve artifact paths against their own --control-plane")
    p.add_argument("--default-min-replicas", type=int, metavar="N",
                   help="engines holding an adapter that sets no replicas.min (LORAPLANE_DEFAULT_MIN_REPLICAS; default 1)")
    p.add_argument("--default-max-replicas", type=_max_replicas, metavar="N|all",
                   help="the most engines demand scaling gives an adapter that sets no replicas.max "
                   "(LORAPLANE_DEFAULT_MAX_REPLICAS; default 3)")
    p.add_argument("--log-level", help="LORAPLANE_LOG_LEVEL (default info)")
    add_log_format_argument(p, env_default=False)  # the settings read LORAPLANE_LOG_FORMAT
    sub = p.add_subparsers(dest="command")
    db = sub.add_parser("db", help="database schema (Alembic)").add_subparsers(dest="db_command", required=True)
    up = db.add_parser("upgrade", help="migrate to REVISION (default head)")
    up.add_argument("revision", nargs="?", default="head")
    down = db.add_parser("downgrade", help="migrate down to REVISION (e.g. base, -1)")
    down.add_argument("revision")
    db.add_parser("current", help="print the database's revision")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        settings, deprecations = settings_from_args(args)
    except ValueError as exc:
        print(f"loraplane control: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    for deprecation in deprecations:
        logger.warning("%s", deprecation)
    if args.command == "db":
        return asyncio.run(_db(settings, args.db_command, getattr(args, "revision", None)))
    return _serve(settings)


def settings_from_args(args: argparse.Namespace) -> tuple[ControlPlaneSettings, list[str]]:
    """The settings from flags over `LORAPLANE_*` variables, and the deprecated spellings used (said once
    logging is set up, in the format the settings choose)."""
    roots = [*(args.lora_roots or ()), *(args.adapter_root or ())]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FutureWarning)
        if args.adapter_root:
            warnings.warn("--adapter-root is deprecated; use --lora-roots DIR… (the same directories)",
                          FutureWarning, stacklevel=1)
        settings = ControlPlaneSettings.from_env(
            host=args.host, port=args.port, database_url=args.database_url,
            adapter_roots=tuple(roots) if roots else None,
            reconcile_interval_s=args.reconcile_interval_s, log_level=args.log_level,
            artifact_store=args.artifact_store, max_artifact_bytes=args.max_artifact_bytes,
            public_url=args.public_url, default_min_replicas=args.default_min_replicas,
            default_max_replicas=args.default_max_replicas,
            log_format=args.log_format, migrate_on_start=False if args.command == "db" else None,
        )
    return settings, [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


def _max_replicas(raw: str) -> int:
    try:
        return parse_max_replicas(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or 'all', not {raw!r}") from None


async def _db(settings: ControlPlaneSettings, command: str, revision: str | None) -> int:
    from control_plane.db import migrate
    from control_plane.db.session import create_engine

    engine = create_engine(settings)
    try:
        if command == "upgrade":
            await migrate.upgrade(engine, revision or "head")
        elif command == "downgrade":
            await migrate.downgrade(engine, revision or "base")
        print(await migrate.current(engine) or "base (empty)")
    finally:
        await engine.dispose()
    return 0


def _serve(settings: ControlPlaneSettings) -> int:
    if not settings.admin_tokens:
        print("loraplane control: set LORAPLANE_ADMIN_TOKENS (comma-separated) so that admin calls can be "
              "authenticated", file=sys.stderr)
        return 2
    import uvicorn

    from control_plane.app import create_app

    logger.info("control plane on http://%s:%d (%s)", settings.host, settings.port, settings.safe_database_url)
    # log_config=None: uvicorn's loggers keep the handler configure_logging set (one format for all)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level,
                log_config=None, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    return 0
