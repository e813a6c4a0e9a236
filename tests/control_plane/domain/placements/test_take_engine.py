"""A reconcile round takes its engine's row on PostgreSQL (engine_rows.take_engine): it waits out a heartbeat
committing on that row (SKIP LOCKED skipped such engines, one to five a pass at fleet scale), and skips an
engine whose row another round holds for longer than LOCK_WAIT_MS."""

from __future__ import annotations

import asyncio

import asyncpg
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from control_plane.db import migrate
from control_plane.domain.placements.engine_rows import take_engine
from tests.control_plane.domain.adapters.helpers import add_engines
from tests.control_plane.test_db_connection_loss import _dsn, pg_settings  # noqa: F401 (fixture)


async def _hold_row(url: str, seconds: float, started: asyncio.Event, heartbeat: bool) -> None:
    """Another connection holding e1's row for `seconds`: a heartbeat's UPDATE, or a round's FOR NO KEY UPDATE."""
    conn = await asyncpg.connect(_dsn(url), timeout=5)
    try:
        async with conn.transaction():
            if heartbeat:
                await conn.execute("UPDATE engines SET last_heartbeat = now() WHERE name = 'e1'")
            else:
                await conn.execute("SELECT 1 FROM engines WHERE name = 'e1' FOR NO KEY UPDATE")
            started.set()
            await asyncio.sleep(seconds)
    finally:
        await conn.close()


async def _take_while_held(url: str, seconds: float, heartbeat: bool) -> str | None:
    database = create_async_engine(url)
    try:
        started = asyncio.Event()
        holder = asyncio.create_task(_hold_row(url, seconds, started, heartbeat))
        await started.wait()
        async with async_sessionmaker(database, expire_on_commit=False)() as session:
            engine = await take_engine(session, "e1", is_sqlite=False)
            name = engine.name if engine is not None else None
            await session.commit()
        await holder
        return name
    finally:
        await database.dispose()


async def test_a_round_waits_out_a_heartbeat_and_skips_an_engine_another_round_holds(pg_settings) -> None:  # noqa: ANN001, F811
    url = pg_settings.database_url
    database = create_async_engine(url)
    await migrate.upgrade(database)  # as the app does when it starts
    await database.dispose()
    await add_engines(url, ("e1", "demo", "healthy"))
    assert await _take_while_held(url, 0.1, heartbeat=True) == "e1"
    assert await _take_while_held(url, 2.0, heartbeat=False) is None
    assert await _take_while_held(url, 0.0, heartbeat=False) == "e1"  # and the session is usable after a skip
