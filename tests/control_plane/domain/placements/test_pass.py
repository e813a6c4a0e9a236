"""The fleet pass's rules on recorded state, with engines that never answer (rows only, as in
tests/control_plane/domain/adapters/test_replicas.py): drained and deleted engines' adapters are
re-placed, the old placement goes only once the new one is observed loaded, unloaded adapters stay
unloaded, and on PostgreSQL only the replica holding the advisory lock decides."""

from __future__ import annotations

import asyncpg
import pytest
from litestar.testing import AsyncTestClient
from sqlalchemy import update
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from control_plane.db.models import Placement
from control_plane.domain.placements.fleet import LEADER_LOCK, FleetPass
from tests.control_plane.conftest import _dsn, admin, reader
from tests.control_plane.domain.adapters.helpers import UNREACHABLE

ENGINES = "/v1/engines"


async def register(client: AsyncTestClient, name: str) -> None:
    body = {"name": name, "url": UNREACHABLE, "base_model": "demo", "slots_total": 4}
    assert (await client.post(f"{ENGINES}/register", json=body, headers=admin())).status_code == 200


async def holding(client: AsyncTestClient, name: str) -> dict[str, dict]:
    detail = (await client.get(f"/v1/lora_adapters/{name}", headers=reader())).json()
    return {p["engine"]: p for p in detail["placements"] if p["desired"] in ("loaded", "pinned")}


async def reconcile(client: AsyncTestClient) -> None:
    assert (await client.post(f"{ENGINES}/reconcile", headers=admin())).status_code == 200


async def observe_loaded(url: str, engine_name: str) -> None:
    """What the engine's answer would record: its placements observed loaded."""
    db = create_async_engine(url)
    try:
        async with async_sessionmaker(db)() as session:
            from sqlalchemy import select

            from control_plane.db.models import Engine
            engine_id = await session.scalar(select(Engine.id).where(Engine.name == engine_name))
            await session.execute(update(Placement).where(Placement.engine_id == engine_id).values(observed="loaded"))
            await session.commit()
    finally:
        await db.dispose()


async def test_a_drained_or_deleted_engines_adapter_is_replaced_make_before_break(
        client: AsyncTestClient, demo: dict, settings) -> None:
    await register(client, "e0")
    await register(client, "e1")
    r = await client.post("/v1/load_lora_adapter", headers=admin(),
                          json={"lora_name": "a", "lora_path": str(demo["demo-short"]), "base_model": "demo"})
    [first] = [e["engine"] for e in r.json()["engines"]]
    other = ({"e0", "e1"} - {first}).pop()
    assert (await client.post(f"{ENGINES}/{first}/drain", headers=admin())).status_code == 200
    await reconcile(client)
    held = await holding(client, "a")
    assert set(held) == {first, other}  # the new one is not loaded yet: the old one stays desired
    await observe_loaded(settings.database_url, other)
    await reconcile(client)
    assert set(await holding(client, "a")) == {other}  # replaced: the drained engine's placement goes

    assert (await client.delete(f"{ENGINES}/{other}", headers=admin())).status_code == 200
    await reconcile(client)
    assert await holding(client, "a") == {}  # no healthy engine left (the other one drains)
    await register(client, "e2")  # a registration runs the pass: placed on the newcomer
    for _ in range(50):
        if set(await holding(client, "a")) == {"e2"}:
            break
        await reconcile(client)
    assert set(await holding(client, "a")) == {"e2"}


async def test_an_unloaded_adapter_is_not_placed_again(client: AsyncTestClient, demo: dict) -> None:
    await register(client, "e0")
    await client.post("/v1/load_lora_adapter", headers=admin(),
                      json={"lora_name": "u", "lora_path": str(demo["demo-short"]), "base_model": "demo"})
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "u"}, headers=admin())
    assert r.status_code == 502 and r.json()["engines"][0]["desired"] == "absent"  # nobody answers there
    await register(client, "e1")
    await reconcile(client)
    assert await holding(client, "u") == {}


async def test_only_the_replica_holding_the_advisory_lock_decides(client: AsyncTestClient, demo: dict,
                                                                  settings) -> None:
    if settings.is_sqlite:
        pytest.skip("advisory locks: PostgreSQL only (SQLite runs a single replica)")
    await register(client, "e0")
    fleet = FleetPass(settings)
    db = create_async_engine(settings.database_url)
    other = await asyncpg.connect(_dsn(settings.database_url), timeout=5)
    try:
        await other.execute("SELECT pg_advisory_lock($1)", LEADER_LOCK)  # another replica's pass under way
        async with async_sessionmaker(db)() as session:
            assert (await fleet.run(session)).skipped
            await session.rollback()
        await other.execute("SELECT pg_advisory_unlock($1)", LEADER_LOCK)
        async with async_sessionmaker(db)() as session:
            assert not (await fleet.run(session)).skipped
            await session.rollback()
    finally:
        await other.close()
        await db.dispose()
