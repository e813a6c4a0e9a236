"""Router presence through POST /v1/routes/demand and GET /v1/routers, on SQLite and PostgreSQL: a report
lists its router (a later one replaces the row), a silent router turns stale and a day-old one is
forgotten, replicas sharing one token keep their own demand rows, bad presence is a 400; and a version
records who registered it."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient
from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from control_plane.app import create_app
from control_plane.auth import token_id
from control_plane.db.models import Adapter, DemandReport, RouterInstance
from shared.routes import DEMAND_PATH, MAX_COUNT
from tests.control_plane.conftest import ADMIN, admin, reader

ROUTER_TOKEN = "router-token-for-presence-tests"
ROUTER = {"Authorization": f"Bearer {ROUTER_TOKEN}"}


@pytest.fixture
async def cp(settings) -> AsyncIterator[AsyncTestClient]:
    async with AsyncTestClient(app=create_app(dataclasses.replace(settings, router_tokens=(ROUTER_TOKEN,)))) as c:
        yield c


async def report(cp: AsyncTestClient, name: str, **extra: object) -> None:
    r = await cp.post(DEMAND_PATH, json={"router": {"name": name, **extra}}, headers=ROUTER)
    assert r.status_code == 200, r.text


async def routers(cp: AsyncTestClient) -> dict[str, dict]:
    r = await cp.get("/v1/routers", headers=reader())
    assert r.status_code == 200, r.text
    return {row["name"]: row for row in r.json()["data"]}


async def in_db(settings, fn):  # noqa: ANN001, ANN201
    db = create_async_engine(settings.database_url)
    try:
        async with async_sessionmaker(db)() as s:
            return await fn(s)
    finally:
        await db.dispose()


async def test_a_report_lists_its_router_and_the_next_replaces_the_row(cp: AsyncTestClient) -> None:
    assert await routers(cp) == {}
    await report(cp, "r1", url="http://10.0.0.9:8000", running=3, waiting=1, table_age_s=0.4)
    first = (await routers(cp))["r1"]
    assert (first["state"], first["url"], first["running"], first["waiting"], first["table_age_s"]) == (
        "up", "http://10.0.0.9:8000", 3, 1, 0.4)
    await report(cp, "r1", running=0)
    again = await routers(cp)
    assert list(again) == ["r1"]
    assert (again["r1"]["running"], again["r1"]["url"], again["r1"]["table_age_s"]) == (0, None, None)
    assert again["r1"]["first_seen_at"] == first["first_seen_at"]
    assert again["r1"]["last_seen_at"] >= first["last_seen_at"]


async def test_a_silent_router_turns_stale_and_a_day_old_one_is_forgotten(cp: AsyncTestClient, settings) -> None:
    now = dt.datetime.now(dt.UTC)

    async def add_old(s) -> None:  # noqa: ANN001
        for name, ago in (("quiet", dt.timedelta(minutes=1)), ("gone", dt.timedelta(days=2))):
            s.add(RouterInstance(name=name, token_id="x", url=None, running=0, waiting=0, table_age_s=None,
                                 first_seen_at=now - ago, last_seen_at=now - ago))
        await s.commit()

    await in_db(settings, add_old)
    assert {n: r["state"] for n, r in (await routers(cp)).items()} == {"gone": "stale", "quiet": "stale"}
    await report(cp, "r1")  # a report forgets routers silent for a day
    assert {n: r["state"] for n, r in (await routers(cp)).items()} == {"quiet": "stale", "r1": "up"}


async def test_replicas_sharing_a_token_keep_their_own_demand(cp: AsyncTestClient, demo: dict[str, Path],
                                                              settings) -> None:
    r = await cp.post("/v1/load_lora_adapter", headers=admin(), json={
        "lora_name": "wanted", "lora_path": str(demo["demo-poet"]), "base_model": "demo", "engines": []})
    assert r.status_code == 200, r.text
    for name, waiting in (("r1", 3), ("r2", 2), ("r1", 4)):
        r = await cp.post(DEMAND_PATH, headers=ROUTER, json={
            "router": {"name": name}, "demand": [{"model": "wanted", "waiting": waiting}]})
        assert r.status_code == 200, r.text

    async def rows(s) -> list[tuple]:  # noqa: ANN001
        found = await s.execute(select(DemandReport.source, DemandReport.waiting).join(Adapter)
                                .where(Adapter.name == "wanted").order_by(DemandReport.source))
        return [tuple(row) for row in found]

    tid = token_id(ROUTER_TOKEN)
    assert await in_db(settings, rows) == [(f"router:{tid}:r1", 4), (f"router:{tid}:r2", 2)]


async def test_the_largest_counts_are_stored_as_sent(cp: AsyncTestClient) -> None:
    await report(cp, "r1", running=MAX_COUNT, waiting=MAX_COUNT)  # the INTEGER columns' largest value
    row = (await routers(cp))["r1"]
    assert (row["running"], row["waiting"]) == (MAX_COUNT, MAX_COUNT)
    r = await cp.post(DEMAND_PATH, json={"demand": [{"model": "m", "waiting": MAX_COUNT + 1}]}, headers=ROUTER)
    assert r.status_code == 400 and "waiting" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("presence", [
    {"name": ""}, {"name": "r\u0000"}, {"name": "r\n1"}, {"name": "x" * 257}, {"name": "r", "url": "http://a\u0000"},
    {"name": "r", "running": -1}, {"name": "r", "table_age_s": -1.0}, {"url": "http://x"},
    {"name": "r", "waiting": MAX_COUNT + 1}, {"name": "r", "running": 4196402182260551126614016},
])
async def test_bad_presence_is_a_400_naming_the_field(cp: AsyncTestClient, presence: dict) -> None:
    r = await cp.post(DEMAND_PATH, json={"router": presence}, headers=ROUTER)
    assert r.status_code == 400, r.text
    assert "router" in r.json()["error"]["message"]
    assert await routers(cp) == {}


async def test_only_read_and_admin_tokens_list_routers(cp: AsyncTestClient) -> None:
    assert (await cp.get("/v1/routers", headers=admin())).status_code == 200
    assert (await cp.get("/v1/routers", headers=ROUTER)).status_code == 403
    assert (await cp.get("/v1/routers")).status_code == 401


async def test_a_version_records_who_registered_it(cp: AsyncTestClient, demo: dict[str, Path]) -> None:
    for folder in ("demo-poet", "demo-short"):
        r = await cp.post("/v1/load_lora_adapter", headers=admin(), json={
            "lora_name": "authored", "lora_path": str(demo[folder]), "base_model": "demo", "engines": []})
        assert r.status_code == 200, r.text
    versions = (await cp.get("/v1/lora_adapters/authored", headers=reader())).json()["versions"]
    assert [(v["number"], v["created_by"]) for v in versions] == [(1, f"admin:{token_id(ADMIN)}"),
                                                                 (2, f"admin:{token_id(ADMIN)}")]
