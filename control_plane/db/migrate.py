"""Alembic, driven from Python: upgrade/downgrade/current on an async engine, inside the caller's loop.

The app calls `upgrade(engine)` at start; `loraplane control db …` calls the same functions. On
PostgreSQL an advisory lock serialises replicas that start at the same moment, so only one of them
migrates and the others find the schema already at head.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
# An arbitrary constant: the key of the PostgreSQL advisory lock held while migrating.
_MIGRATION_LOCK_KEY = 0x10_7A_91_A5


def alembic_config(connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["connection"] = connection
    return cfg


async def upgrade(engine: AsyncEngine, revision: str = "head") -> None:
    await _run(engine, lambda cfg: command.upgrade(cfg, revision))


async def downgrade(engine: AsyncEngine, revision: str) -> None:
    await _run(engine, lambda cfg: command.downgrade(cfg, revision))


async def current(engine: AsyncEngine) -> str | None:
    """The revision the database is at, or None for an empty database."""
    async with engine.connect() as conn:
        return await conn.run_sync(lambda c: MigrationContext.configure(c).get_current_revision())


async def _run(engine: AsyncEngine, fn) -> None:  # noqa: ANN001
    async with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            await conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _MIGRATION_LOCK_KEY})
            await conn.commit()
        try:
            await conn.run_sync(lambda c: fn(alembic_config(c)))
            await conn.commit()
        finally:
            if conn.dialect.name == "postgresql":
                await conn.rollback()
                await conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _MIGRATION_LOCK_KEY})
                await conn.commit()
