"""Placement rows are locked in one order, ascending id, by every writer (domain/adapters/placement.py).

The deadlock the fault suite logged: the reconciler on one replica updated an engine's placements in id
order while a push recorded on the other replica updated the loaded row first and then the adapter's
older rows on that engine (lower ids): each held a row the other wanted. Here a push is recorded while
another connection holds the higher row; recording in ascending id, it already holds the lower one while
it waits (before: it waited holding nothing, and took the lower row after the higher, the other order).
"""

from __future__ import annotations

import asyncio

import asyncpg
from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from control_plane.db.models import Adapter, AdapterVersion, DesiredState, Engine, ObservedState, Placement
from control_plane.db.session import WriteGate
from control_plane.domain.adapters.placement import PushOrder
from control_plane.domain.adapters.push import Pusher
from control_plane.domain.adapters.schemas import EngineOutcome
from control_plane.engine_client import EngineClient
from tests.control_plane.conftest import admin
from tests.control_plane.domain.adapters.helpers import add_engines
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
        order = PushOrder(engine_id=e1.id, engine="e1", url=e1.url, adapter="alpha", action="load",
                          desired=DesiredState.LOADED.value, placement_ids=(new.id,), path=v2.uri,
                          adapter_id=adapter.id, sha256=v2.sha256, version=2)
    assert old.id < new.id
    holder = await asyncpg.connect(_dsn(url), timeout=5)
    prober = await asyncpg.connect(_dsn(url), timeout=5)
    client_ = EngineClient("token", 1.0)
    try:
        async with sessions() as session:
            pusher = Pusher(client_, session, WriteGate(serialize=False))
            outcome = EngineOutcome(engine="e1", desired="loaded", outcome="loaded")
            async with holder.transaction():
                await holder.execute("SELECT id FROM placements WHERE id = $1 FOR UPDATE", new.id)
                raw = await (await session.connection()).get_raw_connection()
                pid = raw.dbapi_connection._connection.get_server_pid()
                recording = asyncio.create_task(pusher._record([order], [outcome]))
                await _wait_until_blocked(prober, pid)  # waiting for the higher row ...
                async with prober.transaction():  # ... while it already holds the lower one?
                    locked = await prober.fetch("SELECT id FROM placements WHERE id = $1 FOR UPDATE SKIP LOCKED",
                                                old.id)
            await asyncio.wait_for(recording, 10)  # the holder committed: the recording completes
        assert locked == [], "the push recording took the higher placement row before the lower one"
    finally:
        await holder.close()
        await prober.close()
        await client_.aclose()
        await engine.dispose()
    rows = {r["id"]: (r["observed"], r["last_error"]) for r in await _placements(url)}
    assert rows == {old.id: ("absent", None), new.id: ("loaded", None)}


async def _placements(url: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(_dsn(url), timeout=5)
    try:
        return await conn.fetch("SELECT id, observed, last_error FROM placements")
    finally:
        await conn.close()
