"""GET /v1/routes and POST /v1/routes/demand against two real engines: the table lists them, their base
model and the adapters they hold; ETag revalidation answers 304 until a load, an unload or an engine
change; a router token reads and reports but cannot load; `place` gets an unplaced adapter loaded."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from control_plane.auth import token_id
from control_plane.db.models import Adapter, DemandReport
from shared.routes import DEMAND_PATH, ROUTES_PATH, DemandAnswer, RoutesTable
from tests.control_plane.conftest import admin
from tests.control_plane.engines import (
    engine_adapters,
    engine_credentials,
    engine_pair,
    register_pair,
    served_control_plane,
)
from tests.data_plane.api.conftest import EngineServer
from tests.e2e.test_control_plane_engines import ENGINE_SECRET
from tests.e2e.test_control_plane_engines import _free_port as free_port

ROUTER_TOKEN = "router-token-for-route-tests"
ROUTER = {"Authorization": f"Bearer {ROUTER_TOKEN}"}


@pytest.fixture(scope="module")
def cp_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def engines(demo: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, cp_port: int) -> Iterator[list[EngineServer]]:
    with engine_pair(demo, tmp_path_factory.mktemp("route_engines"), f"http://127.0.0.1:{cp_port}") as pair:
        yield pair


@pytest.fixture
async def cp(settings, engines: list[EngineServer], cp_port: int) -> AsyncIterator[httpx.AsyncClient]:
    settings = dataclasses.replace(settings, engine_token_secret=ENGINE_SECRET, engine_credentials=engine_credentials(),
                                   router_tokens=(f"edge={ROUTER_TOKEN}",))  # a named token
    async with served_control_plane(settings, cp_port) as c:
        await register_pair(c, engines, admin())
        yield c


async def routes(cp: httpx.AsyncClient, etag: str | None = None) -> httpx.Response:
    return await cp.get(ROUTES_PATH, headers={**ROUTER, **({"If-None-Match": etag} if etag else {})})


async def table(cp: httpx.AsyncClient) -> tuple[RoutesTable, str]:
    r = await routes(cp)
    assert r.status_code == 200, r.text
    decoded = msgspec.json.decode(r.content, type=RoutesTable)
    assert decoded.etag == r.headers["etag"]
    return decoded, r.headers["etag"]


def holders(t: RoutesTable) -> dict[str, list[tuple[str, str]]]:
    return {m.model: [(h.engine, h.residency) for h in m.holders] for m in t.models}


async def load(cp: httpx.AsyncClient, name: str, folder: Path, **extra: object) -> dict:
    r = await cp.post("/v1/load_lora_adapter", headers=admin(),
                      json={"lora_name": name, "lora_path": str(folder), "base_model": "demo", **extra})
    assert r.status_code == 200, r.text
    return r.json()


async def test_the_table_lists_engines_base_and_adapters_with_their_holders(
        cp: httpx.AsyncClient, engines: list[EngineServer], demo: dict) -> None:
    await load(cp, "everywhere", demo["demo-pirate"], engines=["ea", "eb"])
    await load(cp, "on-eb", demo["demo-poet"], engines=["eb"])
    await load(cp, "nowhere", demo["demo-short"], engines=[])
    t, _ = await table(cp)
    assert [(e.name, e.url, e.base_model) for e in t.engines] == [
        ("ea", engines[0].url, "demo"), ("eb", engines[1].url, "demo")]
    assert [(m.model, m.kind, m.base_model) for m in t.models] == [
        ("demo", "base", "demo"), ("everywhere", "adapter", "demo"), ("nowhere", "adapter", "demo"),
        ("on-eb", "adapter", "demo")]
    held = holders(t)
    assert held["demo"] == [("ea", "device"), ("eb", "device")]  # a base model is always on device
    # loaded adapters: where the engines last said (device slot or host cache; `device` until reported)
    assert {m: [e for e, _ in h] for m, h in held.items()} == {
        "demo": ["ea", "eb"], "everywhere": ["ea", "eb"], "nowhere": [], "on-eb": ["eb"]}
    assert {r for h in held.values() for _, r in h} <= {"device", "host"}
    assert "on-eb" in engine_adapters(engines[1], "eb") and "on-eb" not in engine_adapters(engines[0], "ea")


async def test_revalidation_is_304_until_a_load_an_unload_or_an_engine_changes(
        cp: httpx.AsyncClient, demo: dict) -> None:
    _, first = await table(cp)
    assert first.startswith('"') and first.endswith('"') and len(first) == 66
    for sent in (first, f"W/{first}", f'"other", {first}', "*"):
        r = await routes(cp, sent)
        assert r.status_code == 304 and r.content == b"" and r.headers["etag"] == first, (sent, r.text)
    assert (await routes(cp, '"other"')).status_code == 200
    seen = [first]

    async def changed() -> RoutesTable:
        r = await routes(cp, seen[-1])
        assert r.status_code == 200 and r.headers["etag"] != seen[-1], r.text
        seen.append(r.headers["etag"])
        assert (await routes(cp, seen[-1])).status_code == 304  # and stable again
        return msgspec.json.decode(r.content, type=RoutesTable)

    await load(cp, "etag-a", demo["demo-pirate"])
    assert "etag-a" in holders(await changed())
    r = await cp.post("/v1/unload_lora_adapter", json={"lora_name": "etag-a"}, headers=admin())
    assert r.status_code == 200, r.text
    assert "etag-a" not in holders(await changed())  # unloaded: routers answer 404 for it, as engines do
    assert seen[-1] == first  # the same table as before the load: the same ETag
    r = await cp.post("/v1/engines/register", headers=admin(),
                      json={"name": "ec", "url": "http://127.0.0.1:1", "base_model": "demo"})
    assert r.status_code == 200
    assert [e.name for e in (await changed()).engines] == ["ea", "eb", "ec"]
    assert (await cp.post("/v1/engines/ec/drain", headers=admin())).status_code == 200
    t = await changed()
    assert [e.name for e in t.engines] == ["ea", "eb"] and holders(t)["demo"] == [("ea", "device"), ("eb", "device")]


async def test_a_router_token_reads_and_reports_but_cannot_load(cp: httpx.AsyncClient, demo: dict) -> None:
    assert (await routes(cp)).status_code == 200
    r = await cp.post(DEMAND_PATH, json={"demand": [], "place": []}, headers=ROUTER)
    assert r.status_code == 200 and r.json() == {"placed": [], "unknown": []}
    r = await cp.post("/v1/load_lora_adapter", headers=ROUTER,
                      json={"lora_name": "x", "lora_path": str(demo["demo-short"]), "base_model": "demo"})
    assert r.status_code == 403 and "router token" in r.json()["error"]["message"]
    for path in ("/v1/lora_adapters", "/v1/engines", "/v1/lora_stats"):
        assert (await cp.get(path, headers=ROUTER)).status_code == 403, path


async def test_place_loads_an_unplaced_adapter_and_demand_is_recorded(
        cp: httpx.AsyncClient, engines: list[EngineServer], demo: dict, settings) -> None:
    await load(cp, "wanted", demo["demo-poet"], engines=[])
    assert holders((await table(cp))[0])["wanted"] == []
    report = {"demand": [{"model": "wanted", "waiting": 3, "running": 1}, {"model": "wanted", "waiting": 2},
                         {"model": "demo", "waiting": 5}, {"model": "nope", "running": 9}],
              "place": ["wanted", "nope", "wanted"]}
    r = await cp.post(DEMAND_PATH, json=report, headers=ROUTER)
    assert r.status_code == 200, r.text
    answer = msgspec.json.decode(r.content, type=DemandAnswer)
    assert answer.unknown == ["nope"]
    assert [m.model for m in answer.placed] == ["wanted"]
    placed = [(h.engine, h.residency) for h in answer.placed[0].holders]
    assert placed and all(residency in ("device", "host") for _, residency in placed)  # pushed before the answer
    by_name = {"ea": engines[0], "eb": engines[1]}
    assert all("wanted" in engine_adapters(by_name[e], e) for e, _ in placed)
    assert [e for e, _ in holders((await table(cp))[0])["wanted"]] == [e for e, _ in placed]
    # asking again while it is held places nothing more
    again = msgspec.json.decode((await cp.post(DEMAND_PATH, json={"place": ["wanted"]}, headers=ROUTER)).content,
                                type=DemandAnswer)
    assert [h.engine for h in again.placed[0].holders] == [e for e, _ in placed]
    # audited under the router token's name, and only the call that placed something
    trail = (await cp.get("/v1/audit", params={"action": "place_adapters"}, headers=admin())).json()["data"]
    assert [(e["actor"], e["target"], e["outcome"]) for e in trail] == [("router:edge", "wanted, nope", "ok")]
    r = await cp.post(DEMAND_PATH, json={"place": ["nope"]}, headers=ROUTER)  # nothing to place: no row
    assert r.status_code == 200 and r.json()["unknown"] == ["nope"], r.text
    assert (await cp.get("/v1/audit", params={"action": "place_adapters"}, headers=admin())).json()["total"] == 1
    # the figures: one row per registered adapter under this router's source, duplicates added up
    db = create_async_engine(settings.database_url)
    try:
        async with async_sessionmaker(db)() as s:
            rows = (await s.execute(select(DemandReport.source, Adapter.name, DemandReport.waiting,
                                           DemandReport.running).join(Adapter))).all()
    finally:
        await db.dispose()
    assert [tuple(row) for row in rows] == [(f"router:{token_id(ROUTER_TOKEN)}", "wanted", 5, 1)]


async def test_reports_are_bounded(cp: httpx.AsyncClient) -> None:
    r = await cp.post(DEMAND_PATH, json={"place": [f"a{i}" for i in range(257)]}, headers=ROUTER)
    assert r.status_code == 400 and r.json()["error"]["param"] == "place", r.text
    r = await cp.post(DEMAND_PATH, json={"demand": [{"model": "a", "waiting": -1}]}, headers=ROUTER)
    assert r.status_code == 400, r.text
