"""PATCH /v1/lora_adapters/{name} `{pinned}`: every placement holding the adapter becomes desired pinned
(or loaded again), the healthy holders are pushed a load with the new pin, replicas added later follow,
and the change is audited as pin/unpin_lora_adapter. The engines are rows at an address nobody answers
(helpers.add_engines): the desired state is recorded and every push fails at once (502); the CLI's test
(tests/control_plane/admin_cli/) pins on a real engine."""

from __future__ import annotations

from litestar.testing import AsyncTestClient

from tests.control_plane.conftest import admin, reader
from tests.control_plane.domain.adapters.helpers import add_engines, audit
from tests.control_plane.domain.adapters.test_replicas import ADAPTERS, detail, held, load


def desired(d: dict) -> dict[str, str]:
    return {p["engine"]: p["desired"] for p in d["placements"] if p["desired"] != "absent"}


async def test_pin_and_unpin_rewrite_every_holder_and_are_audited(client: AsyncTestClient, demo: dict,
                                                                 settings) -> None:
    await add_engines(settings.database_url, ("e0", "demo", "healthy"), ("e1", "demo", "healthy"),
                      ("sick", "demo", "unhealthy"))
    await load(client, "p", demo["demo-short"], engines=["e0", "e1", "sick"])
    assert (await detail(client, "p"))["pinned"] is False

    r = await client.patch(f"{ADAPTERS}/p", json={"pinned": True}, headers=admin())
    assert r.status_code == 502, r.text  # both healthy holders were told, and neither answers
    body = r.json()
    assert body["pinned"] is True
    # the unhealthy holder is not called (the reconciler tells it when it is back) but is desired pinned
    assert [(e["engine"], e["desired"], e["outcome"]) for e in body["engines"]] == [
        ("e0", "pinned", "failed"), ("e1", "pinned", "failed")]
    assert desired(await detail(client, "p")) == {"e0": "pinned", "e1": "pinned", "sick": "pinned"}

    r = await client.patch(f"{ADAPTERS}/p", json={"pinned": False}, headers=admin())
    assert r.status_code == 502 and r.json()["pinned"] is False, r.text
    assert desired(await detail(client, "p")) == {"e0": "loaded", "e1": "loaded", "sick": "loaded"}
    assert [a for a in await audit(settings.database_url) if a[0].endswith("pin_lora_adapter")] == [
        ("pin_lora_adapter", "p", "ok"), ("unpin_lora_adapter", "p", "ok")]


async def test_replicas_added_with_the_pin_are_pinned_and_each_engine_is_told_once(
        client: AsyncTestClient, demo: dict, settings) -> None:
    await add_engines(settings.database_url, *((f"e{i}", "demo", "healthy") for i in range(3)))
    await load(client, "q", demo["demo-poet"])
    assert len(held(await detail(client, "q"))) == 1
    r = await client.patch(f"{ADAPTERS}/q", json={"pinned": True, "replicas": {"min": 3}}, headers=admin())
    assert r.status_code == 502, r.text
    engines = [e["engine"] for e in r.json()["engines"]]
    assert sorted(engines) == ["e0", "e1", "e2"] and len(set(engines)) == len(engines)
    assert set(desired(await detail(client, "q")).values()) == {"pinned"}
    assert ("update_lora_adapter", "q", "ok") in await audit(settings.database_url)


async def test_pin_refusals(client: AsyncTestClient, demo: dict, settings) -> None:
    await load(client, "nowhere", demo["demo-short"])  # no engine: placed nowhere
    r = await client.patch(f"{ADAPTERS}/nowhere", json={"pinned": True}, headers=admin())
    assert r.status_code == 409 and "nothing to pin" in r.json()["error"]["message"], r.text
    r = await client.patch(f"{ADAPTERS}/nowhere", json={}, headers=admin())
    assert r.status_code == 400 and r.json()["error"]["param"] == "replicas", r.text
    r = await client.patch(f"{ADAPTERS}/missing", json={"pinned": True}, headers=admin())
    assert r.status_code == 404, r.text
    r = await client.patch(f"{ADAPTERS}/nowhere", json={"pinned": True}, headers=reader())
    assert r.status_code == 403, r.text
    assert ("pin_lora_adapter", "nowhere", "409 conflict_error") in await audit(settings.database_url)
