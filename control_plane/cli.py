"""`loraplane control`: run the control plane, or manage its database schema.

    loraplane control [--host H] [--port P] [--database-url URL] [--lora-roots DIR ...] [--log-format text|json]
                      [--default-min-replicas N] [--default-max-replicas N|all]
    loraplane control db upgrade [REVISION] | downgrade REVISION | current

The flags and variables are ControlPlaneSettings' fields (settings.py); `--help` describes the variables
without a flag after the options. Tokens come only from the environment (a flag would leave them in the
process list and shell history): LORAPLANE_ADMIN_TOKENS, LORAPLANE_READ_TOKENS, LORAPLANE_ROUTER_TOKENS,
LORAPLANE_ENGINE_CREDENTIALS (each engine's own token) and LORAPLANE_ENGINE_ADMIN_TOKEN (the engines'
--admin-token; LORAPLANE_ENGINE_TOKEN is its deprecated name).

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

from control_plane.settings import ControlPlaneSettings
from shared.logging_setup import configure_logging
from shared.settings import SettingsParser, deprecations, from_args

# On SIGTERM, connections still open this long after the server stopped accepting are closed: a slow
# artifact download or a client that keeps its connection must not hold the shutdown past a process
# manager's kill (an engine whose fetch is cut retries it on the next reconcile pass)
GRACEFUL_SHUTDOWN_S = 10

logger = logging.getLogger("loraplane.control")


def _parser() -> SettingsParser:
    """ControlPlaneSettings' flags (shared/settings.py), and the `db` commands."""
    p = SettingsParser(ControlPlaneSettings, prog="loraplane control", description=__doc__.split("\n\n")[0])
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
    configure_logging(settings.log_level, settings.log_format, process="control")
    for deprecation in deprecations:
        logger.warning("%s", deprecation)
    if args.command == "db":
        return asyncio.run(_db(settings, args.db_command, getattr(args, "revision", None)))
    return _serve(settings)


def settings_from_args(args: argparse.Namespace) -> tuple[ControlPlaneSettings, list[str]]:
    """The settings from flags over `LORAPLANE_*` variables, and the deprecated spellings used (said once
    logging is set up, in the format the settings choose)."""
    fixed = {"migrate_on_start": False} if args.command == "db" else {}
    return from_args(ControlPlaneSettings, args, **fixed), deprecations(args)


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
