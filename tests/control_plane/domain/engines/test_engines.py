"""Engines API: registration (idempotent by name), heartbeats, stale from missed heartbeats, removal, auth;
an engine's kind and inference URL (listed, in the routing table), and placement of any kind by base model."""

from __future__ import annotations

import asyncio
import dataclasses

from litestar.testing import AsyncTestClient

from control_plane.app import create_app
from tests.control_plane.conftest import admin, reader
from tests.control_plane.domain.adapters.helpers import audit

ENGINES = "/v1/engines"


def spec(name: str = "e1", **extra: object) -> dict:
    return {"name": name, "url": "http://10.0.0.1:8000", "base_model": "demo", "slots_total": 4, **extra}


async def listed(client: AsyncTestClient) -> dict[str, dict]:
    r = await client.get(ENGINES, headers=reader())
    assert r.status_code == 200, r.text
    return {e["name"]: e for e in r.json()["data"]}


async def test_register_is_idempotent_by_name_and_heartbeats_update(client: AsyncTestClient, settings) -> None:
    r = await client.post(f"{ENGINES}/register", json=spec(), headers=admin())
    assert r.status_code == 200, r.text
    first = r.json()
    assert (first["name"], first["state"], first["slots_total"], first["slots_used"]) == ("e1", "healthy", 4, 0)
    assert first["last_heartbeat"] is not None
    again = await client.post(f"{ENGINES}/register", json=spec(url="http://10.0.0.2:8000/", slots_total=8),
                              headers=admin())
    assert again.status_code == 200 and again.json()["url"] == "http://10.0.0.2:8000"
    assert list(await listed(client)) == ["e1"]
    r = await client.post(f"{ENGINES}/e1/heartbeat", json={"slots_used": 3}, headers=admin())
    assert r.status_code == 200 and r.json()["slots_used"] == 3 and r.json()["slots_total"] == 8
    assert r.json()["last_heartbeat"] >= first["last_heartbeat"]
    r = await client.post(f"{ENGINES}/nope/heartbeat", json={}, headers=admin())
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert (await client.post(f"{ENGINES}/e1", json={}, headers=admin())).status_code == 404
    # registrations are audited; heartbeats (every few seconds per engine) are not
    assert await audit(settings.database_url) == [("register_engine", "e1", "ok")] * 2


async def test_missed_heartbeats_read_as_stale_and_get_no_placements(settings, demo: dict) -> None:
    # the window is wide enough that "new" stays fresh on a slow 2-core CI runner (a load there took 0.7 s)
    quick = dataclasses.replace(settings, engine_stale_after_s=2.0)
    async with AsyncTestClient(app=create_app(quick)) as client:
        await client.post(f"{ENGINES}/register", json=spec("old"), headers=admin())
        await asyncio.sleep(2.2)
        await client.post(f"{ENGINES}/register", json=spec("new", url="http://127.0.0.1:1"), headers=admin())
        states = {n: e["state"] for n, e in (await listed(client)).items()}
        assert states == {"new": "healthy", "old": "stale"}
        await client.post(f"{ENGINES}/new/heartbeat", json={}, headers=admin())
        r = await client.post("/v1/load_lora_adapter", headers=admin(), json={
            "lora_name": "a", "lora_path": str(demo["demo-short"]), "base_model": "demo"})
        assert [e["engine"] for e in r.json()["engines"]] == ["new"]  # the stale one is left out
        await client.post(f"{ENGINES}/old/heartbeat", json={}, headers=admin())
        assert (await listed(client))["old"]["state"] == "healthy"


async def test_delete_forgets_the_engine_and_its_placements(client: AsyncTestClient, demo: dict) -> None:
    await client.post(f"{ENGINES}/register", json=spec("gone", url="http://127.0.0.1:1"), headers=admin())
    await client.post("/v1/load_lora_adapter", headers=admin(), json={
        "lora_name": "a", "lora_path": str(demo["demo-short"]), "base_model": "demo"})
    r = await client.delete(f"{ENGINES}/gone", headers=admin())
    assert r.status_code == 200 and r.json() == {"name": "gone", "deleted": True}
    assert await listed(client) == {}
    assert (await client.get("/v1/lora_adapters/a", headers=reader())).json()["placements"] == []
    assert (await client.delete(f"{ENGINES}/gone", headers=admin())).status_code == 404


async def test_engines_auth_and_validation(client: AsyncTestClient) -> None:
    for method, path, body in (("POST", f"{ENGINES}/register", spec()), ("POST", f"{ENGINES}/e1/heartbeat", {}),
                               ("DELETE", f"{ENGINES}/e1", None)):
        assert (await client.request(method, path, json=body)).status_code == 401
        assert (await client.request(method, path, json=body, headers=reader())).status_code == 403
    assert (await client.get(ENGINES)).status_code == 401
    r = await client.post(f"{ENGINES}/register", json=spec(url="not-a-url"), headers=admin())
    assert r.status_code == 400 and r.json()["error"]["param"] == "url"
    r = await client.post(f"{ENGINES}/register", json=spec(slots_total=-1), headers=admin())
    assert r.status_code == 400


async def test_openapi_documents_the_engine_handlers(client: AsyncTestClient) -> None:
    doc = (await client.get("/schema/openapi.json")).json()
    ops = {op["operationId"]: op for path in doc["paths"].values() for op in path.values()}
    for op_id in ("registerEngine", "engineHeartbeat", "drainEngine", "listEngines", "deleteEngine"):
        assert ops[op_id].get("description") or ops[op_id].get("summary")


async def test_kind_and_inference_url_are_stored_shown_routed_and_updated_by_a_reregistration(
        client: AsyncTestClient, settings) -> None:
    async def routed() -> dict[str, dict]:
        table = (await client.get("/v1/routes", headers=reader())).json()
        return {e["name"]: e for e in table["engines"]}

    r = await client.post(f"{ENGINES}/register", json=spec("own"), headers=admin())
    assert (r.json()["kind"], r.json()["inference_url"]) == ("loraplane", None)
    agent = spec("agent", kind="vllm", url="http://10.0.0.2:9000", inference_url="HTTP://10.0.0.3:8000/")
    r = await client.post(f"{ENGINES}/register", json=agent, headers=admin())
    assert r.status_code == 200, r.text
    assert (r.json()["kind"], r.json()["url"], r.json()["inference_url"]) == (
        "vllm", "http://10.0.0.2:9000", "http://10.0.0.3:8000")  # normalized as `url` is
    shown = await listed(client)
    assert {n: (e["kind"], e["inference_url"]) for n, e in shown.items()} == {
        "agent": ("vllm", "http://10.0.0.3:8000"), "own": ("loraplane", None)}
    # the routing table: where routers send inference (the admin URL stays the control plane's)
    table = await routed()
    assert (table["agent"]["url"], table["agent"]["inference_url"]) == ("http://10.0.0.2:9000", "http://10.0.0.3:8000")
    assert table["own"]["inference_url"] is None
    # a re-registration updates both: another inference URL, then none (inference goes to `url` again)
    await client.post(f"{ENGINES}/register", json={**agent, "inference_url": "http://10.0.0.4:8000"}, headers=admin())
    assert (await routed())["agent"]["inference_url"] == "http://10.0.0.4:8000"
    r = await client.post(f"{ENGINES}/register", json=spec("agent", url="http://10.0.0.2:9000"), headers=admin())
    assert (r.json()["kind"], r.json()["inference_url"]) == ("loraplane", None)
    assert (await routed())["agent"]["inference_url"] is None
    # a kind no engine implements, and an inference URL that is no http(s) URL: 400s naming the field
    for bad, param in (({"kind": "sglang"}, "kind"), ({"inference_url": "ftp://10.0.0.3:8000"}, "inference_url"),
                       ({"inference_url": "http://10.0.0.3:8000/v1"}, "inference_url")):
        r = await client.post(f"{ENGINES}/register", json=spec("agent", **bad), headers=admin())
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
    assert (await listed(client))["agent"]["kind"] == "loraplane"  # refused registrations changed nothing


async def test_placement_matches_an_engine_of_any_kind_by_its_served_base_model(client: AsyncTestClient,
                                                                               demo: dict) -> None:
    await client.post(f"{ENGINES}/register", headers=admin(), json=spec(
        "vllm-0", kind="vllm", url="http://127.0.0.1:1", inference_url="http://127.0.0.1:2"))
    await client.post(f"{ENGINES}/register", json=spec("other", url="http://127.0.0.1:3", base_model="other"),
                      headers=admin())
    r = await client.post("/v1/load_lora_adapter", headers=admin(), json={
        "lora_name": "a", "lora_path": str(demo["demo-short"]), "base_model": "demo"})
    assert [e["engine"] for e in r.json()["engines"]] == ["vllm-0"], r.text  # pushed to its agent (absent here)
    placed = (await client.get("/v1/lora_adapters/a", headers=reader())).json()["placements"]
    assert [(p["engine"], p["desired"]) for p in placed] == [("vllm-0", "loaded")]
    assert (await listed(client))["vllm-0"]["kind"] == "vllm"
