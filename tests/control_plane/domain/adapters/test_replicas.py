"""replicas {min, max} through the API: on load, upload and PATCH, shown by GET; loads go to the
engines the replica rules choose (not every engine); a load no engine can take says so in `warning`.

The engines here are rows at an address nobody answers (helpers.add_engines): placements are recorded
and every push fails at once, which is all these rules need; tests/control_plane/domain/placements/
test_fleet.py runs them against real engines."""

from __future__ import annotations

from litestar.testing import AsyncTestClient

from tests.control_plane.artifacts.helpers import files_of
from tests.control_plane.conftest import admin, reader
from tests.control_plane.domain.adapters.helpers import add_engines, audit, placements

ADAPTERS = "/v1/lora_adapters"


async def load(client: AsyncTestClient, name: str, path, **extra: object) -> dict:
    r = await client.post("/v1/load_lora_adapter", headers=admin(),
                          json={"lora_name": name, "lora_path": str(path), "base_model": "demo", **extra})
    assert r.status_code in (200, 502), r.text
    return r.json()


async def detail(client: AsyncTestClient, name: str) -> dict:
    r = await client.get(f"{ADAPTERS}/{name}", headers=reader())
    assert r.status_code == 200, r.text
    return r.json()


def held(d: dict) -> set[str]:
    return {p["engine"] for p in d["placements"] if p["desired"] in ("loaded", "pinned")}


async def test_a_load_goes_to_min_engines_of_its_base_model_not_to_every_one(client: AsyncTestClient, demo: dict,
                                                                            settings) -> None:
    await add_engines(settings.database_url, *((f"e{i}", "demo", "healthy") for i in range(4)),
                      ("other", "other-base", "healthy"))
    body = await load(client, "one", demo["demo-short"])
    assert [e["engine"] for e in body["engines"]] == sorted(held(await detail(client, "one")))
    assert len(body["engines"]) == 1 and body["warning"] is None
    d = await detail(client, "one")
    assert d["replicas"] == {"min": 1, "max": 3, "target": 1, "current": 1} and d["last_decision"] is None
    body = await load(client, "two", demo["demo-poet"], replicas={"min": 2, "max": "all"})
    assert len(body["engines"]) == 2 and held(await detail(client, "two")) <= {f"e{i}" for i in range(4)}
    assert (await detail(client, "two"))["replicas"] == {"min": 2, "max": "all", "target": 2, "current": 2}
    # a new version goes to the engines holding the adapter, no others
    before = held(await detail(client, "two"))
    body = await load(client, "two", demo["demo-pirate"])
    assert {e["engine"] for e in body["engines"]} == before and body["version"] == 2
    # the replicas stay as set when a later load names none; the explicit `engines` override still works
    assert (await detail(client, "two"))["replicas"]["min"] == 2
    body = await load(client, "one", demo["demo-short"], engines=["e0", "e1", "e2"])
    assert [e["engine"] for e in body["engines"]] == ["e0", "e1", "e2"]


async def test_choices_spread_over_the_engines(client: AsyncTestClient, demo: dict, settings) -> None:
    await add_engines(settings.database_url, *((f"e{i}", "demo", "healthy") for i in range(3)))
    for i in range(9):
        await load(client, f"spread-{i}", demo["demo-short"])
    rows = [p for p in await placements(settings.database_url) if p.desired == "loaded"]
    per_engine = {}
    for p in rows:
        per_engine[p.engine_id] = per_engine.get(p.engine_id, 0) + 1
    assert len(rows) == 9 and len(per_engine) == 3  # weighted by free capacity: no engine is left out


async def test_a_load_no_engine_can_take_answers_200_with_a_warning(client: AsyncTestClient, demo: dict,
                                                                    settings) -> None:
    r = await client.post("/v1/load_lora_adapter", headers=admin(),
                          json={"lora_name": "early", "lora_path": str(demo["demo-short"]), "base_model": "later"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["engines"] == []
    assert "no engine serves base model 'later' yet" in body["warning"] and "registers" in body["warning"]
    await add_engines(settings.database_url, ("sick", "later", "unhealthy"))
    body = await load(client, "early", demo["demo-poet"], base_model="later")
    assert body["engines"] == [] and "is healthy" in body["warning"]
    await add_engines(settings.database_url, ("well", "later", "healthy"))
    body = await load(client, "early", demo["demo-pirate"], base_model="later")
    assert [e["engine"] for e in body["engines"]] == ["well"]  # placed; its (unreachable) engine cannot load it
    assert "no engine serves" not in body["warning"] and "is healthy" not in body["warning"]
    assert "stays active" in body["warning"]


async def test_patch_sets_replicas_adds_and_lets_go_at_once(client: AsyncTestClient, demo: dict, settings) -> None:
    await add_engines(settings.database_url, *((f"e{i}", "demo", "healthy") for i in range(4)))
    await load(client, "p", demo["demo-short"])
    r = await client.patch(f"{ADAPTERS}/p", headers=admin(), json={"replicas": {"min": 3, "max": 4}})
    assert r.status_code == 502, r.text  # the two new replicas' pushes fail: nobody answers there
    body = r.json()
    assert len(body["engines"]) == 2 and {e["desired"] for e in body["engines"]} == {"loaded"}
    assert body["replicas"] == {"min": 3, "max": 4, "target": 3, "current": 3} and len(held(body)) == 3
    r = await client.patch(f"{ADAPTERS}/p", headers=admin(), json={"replicas": {"min": 1, "max": 1}})
    body = r.json()
    assert len(held(body)) == 1 and {e["desired"] for e in body["engines"]} == {"absent"} and len(body["engines"]) == 2
    assert body["replicas"] == {"min": 1, "max": 1, "target": 1, "current": 1}
    r = await client.patch(f"{ADAPTERS}/p", headers=admin(), json={"replicas": {}})  # back to the defaults
    assert r.json()["replicas"]["max"] == 3 and r.json()["replicas"]["min"] == 1
    actions = [a for a in await audit(settings.database_url) if a[0] == "update_lora_adapter"]
    assert actions == [("update_lora_adapter", "p", "ok")] * 3


async def test_patch_refusals(client: AsyncTestClient, demo: dict, settings) -> None:
    await load(client, "q", demo["demo-short"])
    r = await client.patch(f"{ADAPTERS}/nobody", headers=admin(), json={"replicas": {"min": 1}})
    assert r.status_code == 404
    r = await client.patch(f"{ADAPTERS}/q", headers=admin(), json={"replicas": {"min": 3, "max": 2}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "replicas"
    assert "min 3 is above replicas.max 2" in r.json()["error"]["message"]
    r = await client.patch(f"{ADAPTERS}/q", headers=admin(), json={"replicas": {"min": 5}})  # default max 3
    assert r.status_code == 400 and "the default" in r.json()["error"]["message"]
    for bad in ({"replicas": {"max": 0}}, {"replicas": {"max": "some"}}, {"replicas": {"low": 1}}, {}):
        assert (await client.patch(f"{ADAPTERS}/q", headers=admin(), json=bad)).status_code == 400, bad
    assert (await client.patch(f"{ADAPTERS}/q", headers=reader(), json={"replicas": {}})).status_code == 403
    r = await client.post("/v1/load_lora_adapter", headers=admin(), json={
        "lora_name": "q", "lora_path": str(demo["demo-short"]), "replicas": {"min": 4, "max": 2}})
    assert r.status_code == 400
    outcomes = [a[2] for a in await audit(settings.database_url) if a[0] == "update_lora_adapter"]
    assert outcomes[:3] == ["404 not_found_error", "400 invalid_request_error", "400 invalid_request_error"]


async def test_an_upload_takes_replicas_as_a_field(client: AsyncTestClient, demo: dict, settings) -> None:
    await add_engines(settings.database_url, *((f"e{i}", "demo", "healthy") for i in range(3)))
    parts = [("files", (n, d)) for n, d in files_of(demo["demo-poet"]).items()]
    r = await client.post(f"{ADAPTERS}/up/versions", headers=admin(), files=parts,
                          data={"base_model": "demo", "replicas": '{"min": 2, "max": "all"}'})
    assert r.status_code == 502 and len(r.json()["engines"]) == 2, r.text
    assert (await detail(client, "up"))["replicas"] == {"min": 2, "max": "all", "target": 2, "current": 2}
    r = await client.post(f"{ADAPTERS}/up/versions", headers=admin(), files=parts, data={"replicas": "{min"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "replicas"
