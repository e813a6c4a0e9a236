"""Alembic, driven from Python: upgrade/downgrade/current on an async engine, inside the caller's loop.

The app calls `upgrade(engine)` at start; `loraplane control db …` calls the same functions. Migrations
never run twice at once:
- within a process, a lock per event loop (Alembic's `context` is a module-global proxy, so two
  interleaved runs would trample each other);
- across PostgreSQL replicas, an advisory lock; across processes on one SQLite file, a lock file next to
  it. The losers wait, then find the schema already at head.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
# An arbitrary constant: the key of the PostgreSQL advisory lock held while migrating.
_PG_LOCK_KEY = 0x107A91A5
_loop_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()


def alembic_config(connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["connection"] = connection
    return cfg


class DatabaseCorruptError(RuntimeError):
    """The database file fails its integrity check: serving from it could lose or invent state."""


async def check_integrity(engine: AsyncEngine) -> None:
    """SQLite: `PRAGMA quick_check` before anything else reads the file, so a damaged database stops the
    start with a message saying what to do, instead of reading as healthy (`SELECT 1` still works on a
    file whose tables are damaged) and failing later, call by call. PostgreSQL checks itself."""
    if engine.dialect.name != "sqlite":
        return
    where = engine.url.database or ":memory:"
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(text("PRAGMA quick_check"))).scalars().all()
    except DBAPIError as exc:  # not a database at all ("file is not a database")
        raise DatabaseCorruptError(_corrupt(where, str(exc.orig))) from None
    if rows != ["ok"]:
        raise DatabaseCorruptError(_corrupt(where, "; ".join(str(r) for r in rows[:5])))


def _corrupt(where: str, finding: str) -> str:
    return (f"the control plane's SQLite database {where} is corrupt (quick_check: {finding[:300]}); restore it "
            "from a backup, or move it away to start with an empty registry (engines then register again)")


async def upgrade(engine: AsyncEngine, revision: str = "head") -> None:
    await _run(engine, lambda cfg: command.upgrade(cfg, revision))


async def downgrade(engine: AsyncEngine, revision: str) -> None:
    await _run(engine, lambda cfg: command.downgrade(cfg, revision))


async def current(engine: AsyncEngine) -> str | None:
    """The revision the database is at, or None for an empty database."""
    async with engine.connect() as conn:
        return await conn.run_sync(lambda c: MigrationContext.configure(c).get_current_revision())


async def _run(engine: AsyncEngine, fn: Callable[[Config], None]) -> None:
    lock = _loop_locks.setdefault(asyncio.get_running_loop(), asyncio.Lock())
    async with lock, engine.connect() as conn, _database_lock(conn):
        await conn.run_sync(lambda c: fn(alembic_config(c)))
        await conn.commit()


@contextlib.asynccontextmanager
async def _database_lock(conn: AsyncConnection) -> AsyncIterator[None]:
    if conn.dialect.name == "postgresql":
        # Session-level lock, taken and committed before the migration's own transaction begins.
        await conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _PG_LOCK_KEY})
        await conn.commit()
        try:
            yield
        finally:
            await conn.rollback()
            await conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _PG_LOCK_KEY})
            await conn.commit()
        return
    database = conn.engine.url.database
    if conn.dialect.name != "sqlite" or not database or database == ":memory:":
        yield
        return
    try:
        import fcntl
    except ImportError:  # not POSIX: the in-process lock is all there is
        yield
        return
    with open(f"{database}.migrate-lock", "a") as fh:
        await asyncio.to_thread(fcntl.flock, fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
