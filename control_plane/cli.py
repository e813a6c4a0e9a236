"""`loraplane control`: run the control plane, or manage its database schema.

    loraplane control [--host H] [--port P] [--database-url URL] [--adapter-root DIR ...]
    loraplane control db upgrade [REVISION] | downgrade REVISION | current

Tokens come only from the environment (a flag would leave them in the process list and shell history):
LORAPLANE_ADMIN_TOKENS, LORAPLANE_READ_TOKENS (comma-separated); LORAPLANE_ENGINE_CREDENTIALS
(`name=token,…`: each engine's own token, good for its name's register/heartbeat/resolve/drain only);
LORAPLANE_ENGINE_ADMIN_TOKEN (old name LORAPLANE_ENGINE_TOKEN: the engines' --admin-token, sent on
pushes). LORAPLANE_ENGINE_ALLOWED_NETWORKS (CIDR, comma-separated): engine URLs must lie in them.
LORAPLANE_ENGINE_TIMEOUT_S (10): total deadline of one engine call. LORAPLANE_ENGINE_STALE_AFTER_S (30):
heartbeats missed for this long make an engine unhealthy.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from control_plane.settings import ControlPlaneSettings


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loraplane control", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", help="bind address (LORAPLANE_HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (LORAPLANE_PORT; default 8080)")
    p.add_argument("--database-url", help="sqlite+aiosqlite:///… or postgresql+asyncpg://… (LORAPLANE_DATABASE_URL)")
    p.add_argument("--adapter-root", action="append", dest="adapter_roots", metavar="DIR",
                   help="directory adapters may be registered from; repeat (LORAPLANE_ADAPTER_ROOTS)")
    p.add_argument("--reconcile-interval-s", type=float, help="LORAPLANE_RECONCILE_INTERVAL_S")
    p.add_argument("--log-level", help="LORAPLANE_LOG_LEVEL (default info)")
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
        settings = ControlPlaneSettings.from_env(
            host=args.host, port=args.port, database_url=args.database_url,
            adapter_roots=tuple(args.adapter_roots) if args.adapter_roots else None,
            reconcile_interval_s=args.reconcile_interval_s, log_level=args.log_level,
            migrate_on_start=False if args.command == "db" else None,
        )
    except ValueError as exc:
        print(f"loraplane control: {exc}", file=sys.stderr)
        return 2
    if args.command == "db":
        return asyncio.run(_db(settings, args.db_command, getattr(args, "revision", None)))
    return _serve(settings)


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

    print(f"loraplane control plane on http://{settings.host}:{settings.port} ({settings.safe_database_url})",
          file=sys.stderr)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level)
    return 0
