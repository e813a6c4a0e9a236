"""Alembic environment for the control plane (async-aware).

Two ways in:
- from the app or `loraplane control db …` (control_plane/db/migrate.py), which hands over an open
  connection in `config.attributes["connection"]` — migrations then run inside the caller's event loop;
- from the plain `alembic` command with `-x url=…` or `sqlalchemy.url`, which opens its own async engine.
"""

from __future__ import annotations

import asyncio

from advanced_alchemy.base import orm_registry
from alembic import context
from sqlalchemy import pool
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

import control_plane.db.models  # noqa: F401  (registers every table on the metadata)

config = context.config
target_metadata = orm_registry.metadata


def _configure(**kwargs: object) -> None:
    context.configure(
        target_metadata=target_metadata,
        # SQLite cannot ALTER constraints; batch mode rebuilds the table instead.
        render_as_batch=True,
        compare_type=True,
        user_module_prefix="sa.",
        **kwargs,
    )


def _run(connection: Connection) -> None:
    _configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()


def _url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: pass `-x url=…` or use `loraplane control db …`")
    return url


async def _run_online() -> None:
    engine = create_async_engine(_url(), poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run)
            await connection.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    _configure(url=_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()
elif (shared := config.attributes.get("connection")) is not None:
    _run(shared)
else:
    asyncio.run(_run_online())
