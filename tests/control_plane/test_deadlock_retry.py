"""A PostgreSQL deadlock (SQLSTATE 40P01) rolls the losing transaction back; a mutation that lost one is
run again (control_plane.db.transaction's rule: a transaction that did not commit can be retried), not answered 500.

Before, the fault suite logged such deadlocks between the reconciler on one replica and a push being
recorded on the other; the lock order (domain/placements/planner.py) removes that pair, and this rule
covers any that remain. The deadlock here is real and deterministic: the mutation's first attempt and a
second connection each hold one engine row and ask for the other's, and the mutation, whose deadlock
timeout is the shorter, is the one PostgreSQL aborts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from control_plane.auth import Principal
from control_plane.db import migrate
from control_plane.db.session import WriteGate
from control_plane.metrics import ControlPlaneMetrics
from control_plane.uow import Mutation
from tests.control_plane.conftest import _truncate, run_blocking
from tests.control_plane.domain.adapters.helpers import add_engines, audit
from tests.control_plane.test_db_connection_loss import _dsn


@pytest.fixture
async def pg(pg_database: str) -> AsyncIterator[AsyncEngine]:
    from control_plane.db.session import create_engine
    from control_plane.settings import ControlPlaneSettings

    engine = create_engine(ControlPlaneSettings(database_url=pg_database, admin_tokens=("t",)))
    await migrate.upgrade(engine)
    run_blocking(_truncate, pg_database)
    await add_engines(pg_database, ("e1", "demo", "healthy"), ("e2", "demo", "healthy"))
    yield engine
    await engine.dispose()


async def _wait_until_blocked(conn: asyncpg.Connection, pid: int) -> None:
    for _ in range(500):
        if await conn.fetchval("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the mutation never waited for the other connection's row")


async def test_a_mutation_that_deadlocks_is_run_again(pg: AsyncEngine, pg_database: str) -> None:
    other = await asyncpg.connect(_dsn(pg_database), timeout=5)
    watcher = await asyncpg.connect(_dsn(pg_database), timeout=5)
    attempts: list[int] = []
    helper: asyncio.Task[None] | None = None

    async def hold_e2_then_want_e1(pid: int) -> None:
        async with other.transaction():
            await other.execute("SET LOCAL deadlock_timeout = '10s'")  # so the mutation is the one aborted
            await other.execute("UPDATE engines SET slots_used = 7 WHERE name = 'e2'")
            holding.set()
            await _wait_until_blocked(watcher, pid)
            await other.execute("UPDATE engines SET slots_used = 7 WHERE name = 'e1'")  # the cycle

    holding = asyncio.Event()

    async def work(session: AsyncSession, _: None) -> str:
        nonlocal helper
        attempts.append(len(attempts) + 1)
        await session.execute(text("SET LOCAL deadlock_timeout = '100ms'"))
        await session.execute(text("UPDATE engines SET slots_used = 1 WHERE name = 'e1'"))
        if len(attempts) == 1:
            pid = (await session.execute(text("SELECT pg_backend_pid()"))).scalar_one()
            helper = asyncio.create_task(hold_e2_then_want_e1(pid))
            await holding.wait()
        await session.execute(text("UPDATE engines SET slots_used = 1 WHERE name = 'e2'"))
        return "done"

    try:
        async with async_sessionmaker(pg, expire_on_commit=False)() as session:
            mutation = Mutation(session, WriteGate(serialize=False), ControlPlaneMetrics())
            result = await mutation.run(Principal(kind="admin", token_id="tok"), "drain_engine", "e1", work)
        assert helper is not None
        await helper  # the other side got its rows once the mutation's first attempt was rolled back
    finally:
        await other.close()
        await watcher.close()
    assert result == "done" and attempts == [1, 2]
    assert await audit(pg_database) == [("drain_engine", "e1", "ok")]
    check = await asyncpg.connect(_dsn(pg_database), timeout=5)
    try:
        rows = await check.fetch("SELECT name, slots_used FROM engines ORDER BY name")
    finally:
        await check.close()
    assert [tuple(r) for r in rows] == [("e1", 1), ("e2", 1)]  # the retry ran after the other committed
