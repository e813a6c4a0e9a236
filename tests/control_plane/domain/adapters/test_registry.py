"""Listing, activation, unload and delete, and the desired placements the planner records."""

from __future__ import annotations

from litestar.testing import AsyncTestClient

from tests.control_plane.conftest import admin, reader
from tests.control_plane.domain.adapters.helpers import add_engines, audit, placements

ADAPTERS = "/v1/lora_adapters"


async def load(client: AsyncTestClient, name: str, path, status: int = 200, **extra: object) -> dict:
    r = await client.post("/v1/load_lora_adapter", headers=admin(),
                          json={"lora_name": name, "lora_path": str(path), "base_model": "demo", **extra})
    assert r.status_code == status, r.text
    return r.json()


async def test_list_pages_and_filters(client: AsyncTestClient, demo: dict) -> None:
    for i in range(7):
        await load(client, f"team-{i % 2}/a{i}", demo["demo-short"], labels={"tier": "gold" if i < 3 else "free"})
    await load(client, "solo", demo["demo-poet"], base_model="other")

    async def names(**params: object) -> tuple[list[str], int]:
        page = (await client.get(ADAPTERS, params=params, headers=reader())).json()
        return [a["name"] for a in page["data"]], page["total"]

    assert await names(limit=3) == (["solo", "team-0/a0", "team-0/a2"], 8)
    assert await names(limit=3, offset=3) == (["team-0/a4", "team-0/a6", "team-1/a1"], 8)
    assert (await names(limit=3, offset=9))[0] == []
    assert await names(base_model="other") == (["solo"], 1)
    assert await names(name_prefix="team-1/") == (["team-1/a1", "team-1/a3", "team-1/a5"], 3)
    assert await names(name_prefix="team_") == ([], 0)  # `_` is literal, not a LIKE wildcard
    assert await names(name_prefix="TEAM") == ([], 0)  # case-sensitive on SQLite as on PostgreSQL
    assert await names(label="tier=gold") == (["team-0/a0", "team-0/a2", "team-1/a1"], 3)
    assert await names(label=["tier=gold", "tier=free"]) == ([], 0)
    assert (await names(label="tier"))[1] == 7
    r = await client.get(ADAPTERS, params={"limit": 0}, headers=reader())
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


async def test_activate_rolls_back_and_forward(client: AsyncTestClient, demo: dict, settings) -> None:
    await load(client, "org/a", demo["demo-pirate"])
    await load(client, "org/a", demo["demo-poet"])
    r = await client.post(f"{ADAPTERS}/org/a/activate", json={"version": 1}, headers=admin())
    assert r.status_code == 200 and r.json()["active_version"] == 1
    r = await client.post(f"{ADAPTERS}/org/a/activate", json={"version": 3}, headers=admin())
    assert r.status_code == 404 and r.json()["error"]["param"] == "version"
    assert (await client.post(f"{ADAPTERS}/org/a/activate", json={"version": 0}, headers=admin())).status_code == 400
    r = await client.post(f"{ADAPTERS}/org/a", json={"version": 1}, headers=admin())  # not …/activate
    assert r.status_code == 405 and r.headers["allow"] == "OPTIONS, GET, DELETE, PATCH"
    assert "POST is not allowed" in r.json()["error"]["message"]
    r = await client.patch(f"{ADAPTERS}/org/a/activate", json={"replicas": {"min": 1}}, headers=admin())
    assert r.status_code == 405 and r.headers["allow"] == "OPTIONS, POST"  # not an adapter named org/a/activate
    assert (await client.post(f"{ADAPTERS}/nope/activate", json={"version": 1}, headers=admin())).status_code == 404
    assert (await client.get(f"{ADAPTERS}/org/a", headers=reader())).json()["active_version"] == 1
    assert ("activate_lora_adapter", "org/a@3", "404 not_found_error") in await audit(settings.database_url)


async def test_unload_then_delete(client: AsyncTestClient, demo: dict, settings) -> None:
    await load(client, "gone", demo["demo-short"])
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "gone"}, headers=admin())
    assert r.status_code == 200 and r.json() == {"name": "gone", "engines": []}
    assert (await client.delete(f"{ADAPTERS}/gone", headers=admin())).json() == {"name": "gone", "deleted": True}
    assert (await client.get(f"{ADAPTERS}/gone", headers=reader())).status_code == 404
    assert (await client.delete(f"{ADAPTERS}/gone", headers=admin())).status_code == 404
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "gone"}, headers=admin())
    assert r.status_code == 404
    assert [a for a, _, o in await audit(settings.database_url) if o == "ok"] == [
        "load_lora_adapter", "unload_lora_adapter", "delete_lora_adapter"]


async def test_planner_records_desired_placements_on_matching_engines(client: AsyncTestClient, demo: dict,
                                                                      settings) -> None:
    await add_engines(settings.database_url, ("e1", "demo", "healthy"), ("e2", "demo", "unhealthy"),
                      ("e3", "other", "healthy"))
    # e1 does not answer (see add_engines): the desired state is recorded all the same, and the answer is
    # 502 naming the failure
    v1 = await load(client, "p", demo["demo-pirate"], status=502, pinned=True)
    [outcome] = v1["engines"]
    assert (outcome["engine"], outcome["desired"], outcome["outcome"]) == ("e1", "pinned", "failed")
    assert "127.0.0.1:1" in outcome["error"]
    v2 = await load(client, "p", demo["demo-poet"], status=502)
    assert [(e["engine"], e["desired"]) for e in v2["engines"]] == [("e1", "loaded")]

    async def desired() -> list[tuple[str, int, str]]:
        detail = (await client.get(f"{ADAPTERS}/p", headers=reader())).json()
        return [(p["engine"], p["version"], p["desired"]) for p in detail["placements"]]

    # no engine could load v2, so v1 stays active (and desired on e1), and the answer says so
    assert v2["active_version"] == 1 and "stays active" in v2["warning"]
    assert await desired() == [("e1", 1, "loaded"), ("e1", 2, "absent")]
    detail = (await client.get(f"{ADAPTERS}/p", headers=reader())).json()
    assert {p["observed"] for p in detail["placements"]} == {"failed"}
    r = await client.post(f"{ADAPTERS}/p/activate", json={"version": 1}, headers=admin())
    assert r.status_code == 502 and r.json()["active_version"] == 1
    assert await desired() == [("e1", 1, "loaded"), ("e1", 2, "absent")]
    r = await client.delete(f"{ADAPTERS}/p", headers=admin())
    assert r.status_code == 409 and r.json()["error"]["type"] == "conflict_error"
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "p"}, headers=admin())
    assert r.status_code == 502
    assert [(e["engine"], e["desired"], e["outcome"]) for e in r.json()["engines"]] == [("e1", "absent", "failed")]
    assert (await client.delete(f"{ADAPTERS}/p", headers=admin())).status_code == 200
    assert await placements(settings.database_url) == []


async def test_named_engines_must_exist_and_serve_the_base_model(client: AsyncTestClient, demo: dict,
                                                                settings) -> None:
    await add_engines(settings.database_url, ("e1", "demo", "unhealthy"), ("e3", "other", "healthy"))
    body = {"lora_name": "n", "lora_path": str(demo["demo-short"]), "base_model": "demo"}
    for engines in (["zz"], ["e3"]):
        r = await client.post("/v1/load_lora_adapter", json={**body, "engines": engines}, headers=admin())
        assert r.status_code == 400 and r.json()["error"]["param"] == "engines"
    assert (await client.get(ADAPTERS, headers=reader())).json()["total"] == 0  # refused: nothing recorded
    r = await client.post("/v1/load_lora_adapter", json={**body, "engines": ["e1"]}, headers=admin())
    assert [e["engine"] for e in r.json()["engines"]] == ["e1"]  # named explicitly: health is not checked


async def test_resolve_names_the_active_version(client: AsyncTestClient, demo: dict) -> None:
    await load(client, "org/r", demo["demo-pirate"])
    v2 = await load(client, "org/r", demo["demo-poet"])
    r = await client.get("/v1/resolve/org/r", params={"base_model": "demo"}, headers=reader())
    assert r.status_code == 200, r.text
    assert r.json() == {"name": "org/r", "version": 2, "uri": str(demo["demo-poet"]), "sha256": v2["sha256"],
                        # the engine fetches it by digest from this control plane (no public URL is set)
                        "artifact": {"digest": v2["sha256"], "url": f"/v1/artifacts/{v2['sha256']}"}}
    await client.post(f"{ADAPTERS}/org/r/activate", json={"version": 1}, headers=admin())
    assert (await client.get("/v1/resolve/org/r", headers=reader())).json()["version"] == 1
    for path, params in (("/v1/resolve/org/r", {"base_model": "other"}), ("/v1/resolve/nobody", {})):
        r = await client.get(path, params=params, headers=reader())
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert (await client.get("/v1/resolve/org/r")).status_code == 401


async def test_an_unloaded_adapter_does_not_resolve(client: AsyncTestClient, demo: dict, settings) -> None:
    await add_engines(settings.database_url, ("e1", "demo", "healthy"))
    await load(client, "u", demo["demo-short"], status=502)  # placed on e1 (which does not answer)
    assert (await client.get("/v1/resolve/u", headers=reader())).status_code == 200
    await client.post("/v1/unload_lora_adapter", json={"lora_name": "u"}, headers=admin())
    r = await client.get("/v1/resolve/u", headers=reader())
    assert r.status_code == 404 and "unloaded" in r.json()["error"]["message"]


async def test_an_engine_resolving_for_itself_is_recorded_as_placed(client: AsyncTestClient, demo: dict,
                                                                    settings) -> None:
    await add_engines(settings.database_url, ("e1", "demo", "healthy"), ("e3", "other", "healthy"))
    await load(client, "pull", demo["demo-short"], engines=[])
    r = await client.get("/v1/resolve/pull", params={"base_model": "demo", "engine": "e1"}, headers=reader())
    assert r.status_code == 200  # a read token may resolve, but records nothing
    assert (await client.get(f"{ADAPTERS}/pull", headers=reader())).json()["placements"] == []
    for engine in ("e1", "e3", "nobody"):  # e3 serves another base model; nobody is not registered
        r = await client.get("/v1/resolve/pull", params={"base_model": "demo", "engine": engine}, headers=admin())
        assert r.status_code == 200 and r.json()["version"] == 1
    placed = (await client.get(f"{ADAPTERS}/pull", headers=reader())).json()["placements"]
    assert [(p["engine"], p["desired"], p["observed"]) for p in placed] == [("e1", "loaded", "loading")]
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "pull"}, headers=admin())
    assert [e["engine"] for e in r.json()["engines"]] == ["e1"]  # the unload now reaches the puller
