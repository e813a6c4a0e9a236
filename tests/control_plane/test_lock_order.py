"""Placement rows are locked in one order, ascending id, by every writer (domain/placements/planner.py).

The deadlock this guards against: the reconciler on one replica updates an engine's placements in id
order while a push recorded on the other replica updates the loaded row first and then the adapter's
older rows on that engine (lower ids): each holds a row the other wants. Here a push is recorded while
another connection holds the higher row; recording in ascending id, it already holds the lower one while
it waits (in the other order it would wait holding nothing and take the lower row after the higher).

The reconciler holds its engine's row for a whole round (engine calls included) FOR NO KEY UPDATE, which a
load inserting a placement for that engine (a key-share lock on it) does not wait for; FOR UPDATE would
make every load for the engine wait for the round, with the load's own placement rows locked meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses

import asyncpg
import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from control_plane.db.models import Adapter, AdapterVersion, DesiredState, Engine, ObservedState, Placement
from control_plane.domain.placements.answers import EngineAnswer, record_answers
from tests.control_plane.conftest import admin
from tests.control_plane.domain.adapters.helpers import add_engines
from tests.control_plane.domain.engines.peers import Reply, always, serve
from tests.control_plane.test_db_connection_loss import _dsn, cp, pg_settings  # noqa: F401 (fixtures)
from tests.control_plane.test_deadlock_retry import _wait_until_blocked


async def test_a_push_is_recorded_in_ascending_placement_id(cp, demo: dict, pg_settings) -> None:  # noqa: ANN001, F811
    client, _ = cp
    url = pg_settings.database_url
    for folder in (demo["demo-pirate"], demo["demo-poet"]):
        r = await client.post("/v1/load_lora_adapter", headers=admin(),
                              json={"lora_name": "alpha", "lora_path": str(folder), "base_model": "demo"})
        assert r.status_code == 200, r.text
    await add_engines(url, ("e1", "demo", "healthy"))
    engine = create_async_engine(url)  # the test's own (the app's runs on its portal's event loop)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    async with sessions() as session:
        e1 = await session.scalar(select(Engine).where(Engine.name == "e1"))
        adapter = await session.scalar(select(Adapter).where(Adapter.name == "alpha"))
        v1, v2 = (await session.scalars(select(AdapterVersion).order_by(AdapterVersion.number))).all()
        old = Placement(engine_id=e1.id, adapter_version_id=v1.id, desired=DesiredState.ABSENT.value,
                        observed=ObservedState.LOADED.value)
        session.add(old)
        await session.flush()
        new = Placement(engine_id=e1.id, adapter_version_id=v2.id, desired=DesiredState.LOADED.value,
                        observed=ObservedState.LOADING.value)
        session.add(new)
        await session.commit()
        # the engine's answer to the load of v2, as a push or a reconcile records it
        answer = EngineAnswer(engine_id=e1.id, placement_ids=(new.id,), observed=ObservedState.LOADED,
                              replaced_adapter_id=adapter.id)
    assert old.id < new.id
    holder = await asyncpg.connect(_dsn(url), timeout=5)
    prober = await asyncpg.connect(_dsn(url), timeout=5)
    try:
        async with sessions() as session:
            async def record() -> None:
                await record_answers(session, [answer])
                await session.commit()

            async with holder.transaction():
                await holder.execute("SELECT id FROM placements WHERE id = $1 FOR UPDATE", new.id)
                raw = await (await session.connection()).get_raw_connection()
                pid = raw.dbapi_connection._connection.get_server_pid()
                recording = asyncio.create_task(record())
                await _wait_until_blocked(prober, pid)  # waiting for the higher row ...
                async with prober.transaction():  # ... while it already holds the lower one?
                    locked = await prober.fetch("SELECT id FROM placements WHERE id = $1 FOR UPDATE SKIP LOCKED",
                                                old.id)
            await asyncio.wait_for(recording, 10)  # the holder committed: the recording completes
        assert locked == [], "recording the answer took the higher placement row before the lower one"
    finally:
        await holder.close()
        await prober.close()
        await engine.dispose()
    rows = {r["id"]: (r["observed"], r["last_error"]) for r in await _placements(url)}
    assert rows == {old.id: ("absent", None), new.id: ("loaded", None)}


async def _placements(url: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(_dsn(url), timeout=5)
    try:
        return await conn.fetch("SELECT id, observed, last_error FROM placements")
    finally:
        await conn.close()


DRIP_S = 0.2  # per byte of the slow engine's every answer: a round on it holds the engine row ~3 s


@pytest.fixture
def settings(pg_settings):  # noqa: ANN001, ANN201, F811 (the app of `concurrent_client`)
    return dataclasses.replace(pg_settings, engine_timeout_s=10, reconcile_interval_s=3600)


async def test_a_load_does_not_wait_for_a_reconcile_round_of_its_engine(
        concurrent_client: httpx.AsyncClient, demo: dict, settings) -> None:  # noqa: ANN001
    url = settings.database_url
    with serve(always(Reply(body=b'{"adapters":[]}', drip_s=DRIP_S))) as slow:
        r = await concurrent_client.post("/v1/engines/register", headers=admin(),
                                         json={"name": "e1", "url": slow.url, "base_model": "demo", "slots_total": 4})
        assert r.status_code == 200, r.text
        prober = await asyncpg.connect(_dsn(url), timeout=5)
        try:
            while not slow.seen:  # the registration's reconcile round is asking the engine: e1's row is held
                await asyncio.sleep(0.01)
            assert await _engine_row_locked(prober)
            load = asyncio.create_task(concurrent_client.post("/v1/load_lora_adapter", headers=admin(), json={
                "lora_name": "alpha", "lora_path": str(demo["demo-pirate"]), "base_model": "demo", "engines": ["e1"]}))
            while not await prober.fetchval("SELECT count(*) FROM adapter_versions"):  # the load committed ...
                assert not load.done(), load.result().text
                await asyncio.sleep(0.01)
            assert await _engine_row_locked(prober), "the load waited for the reconcile round to end"  # ... first
            assert (await load).status_code in (200, 207, 502)  # its push to the slow engine: whatever it says
        finally:
            await prober.close()


async def _engine_row_locked(conn: asyncpg.Connection) -> bool:
    try:
        async with conn.transaction():
            await conn.execute("SELECT 1 FROM engines WHERE name = 'e1' FOR NO KEY UPDATE NOWAIT")
    except asyncpg.LockNotAvailableError:
        return True
    return False
