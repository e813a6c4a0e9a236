"""GET /v1/audit: the rows every mutating call writes, newest first, paged, filtered by adapter (its
name or name@version), actor, action and time; a read token sees them, an engine or router token does not."""

from __future__ import annotations

import datetime as dt

from litestar.testing import AsyncTestClient

from control_plane.auth import token_id
from tests.control_plane.conftest import ADMIN, READ, admin, reader
from tests.control_plane.domain.adapters.test_replicas import ADAPTERS, load


async def events(client: AsyncTestClient, **params: object) -> dict:
    r = await client.get("/v1/audit", params=params, headers=reader())
    assert r.status_code == 200, r.text
    return r.json()


async def test_the_trail_is_paged_newest_first_and_filtered(client: AsyncTestClient, demo: dict) -> None:
    start = dt.datetime.now(dt.UTC)
    await load(client, "a", demo["demo-short"])
    await load(client, "a", demo["demo-poet"])  # version 2
    await load(client, "a_b", demo["demo-short"])  # `_` is no wildcard for the adapter filter
    r = await client.post(f"{ADAPTERS}/a/activate", json={"version": 1}, headers=admin())
    assert r.status_code == 200, r.text
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}, headers=reader())
    assert r.status_code == 403  # a refusal is audited too, under the reader's id

    page = await events(client)
    assert page["total"] == 5 and page["offset"] == 0
    assert [(e["action"], e["target"], e["outcome"]) for e in page["data"]] == [
        ("unload_lora_adapter", "/v1/unload_lora_adapter", "403 permission_error"),
        ("activate_lora_adapter", "a@1", "ok"),
        ("load_lora_adapter", "a_b", "ok"), ("load_lora_adapter", "a", "ok"), ("load_lora_adapter", "a", "ok")]
    assert {e["actor"] for e in page["data"]} == {token_id(ADMIN), token_id(READ)}
    assert ADMIN not in str(page) and READ not in str(page)

    second = await events(client, limit=2, offset=2)
    assert second["total"] == 5 and [e["id"] for e in second["data"]] == [e["id"] for e in page["data"][2:4]]
    assert [e["target"] for e in (await events(client, adapter="a"))["data"]] == ["a@1", "a", "a"]
    assert [e["target"] for e in (await events(client, adapter="a_"))["data"]] == []
    assert (await events(client, actor=token_id(READ)))["total"] == 1
    assert (await events(client, action="load_lora_adapter", adapter="a_b"))["total"] == 1
    assert (await events(client, since=start.isoformat()))["total"] == 5
    future = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%Sz")
    assert (await events(client, since=future))["total"] == 0
    assert (await events(client, since=start.astimezone(dt.timezone(dt.timedelta(hours=-5))).isoformat()))["total"] == 5


async def test_bad_queries_are_400s(client: AsyncTestClient) -> None:
    # RFC 3339 wants the offset; a bare number is no time (the framework's datetime took one as a timestamp)
    naive = dt.datetime.now(dt.UTC).replace(tzinfo=None).isoformat()
    for params in ({"since": "yesterday"}, {"since": "9999-12-31T23:59:59-14:00"}, {"since": "0.5"}, {"since": ""},
                   {"since": naive}, {"since": "2026-02-30T00:00:00Z"}, {"limit": 0},
                   {"offset": -1}, {"actor": "a\x00b"}):
        r = await client.get("/v1/audit", params=params, headers=reader())
        assert r.status_code == 400, (params, r.text)
        assert r.json()["error"]["message"], r.text
    r = await client.get("/v1/audit")
    assert r.status_code == 401
