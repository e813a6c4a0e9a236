"""GET /v1/audit: the rows every mutating call writes, newest first, paged, filtered by adapter (its
name or name@version), actor, action and time; a read token sees them, an engine or router token does not."""

from __future__ import annotations

import dataclasses
import datetime as dt

from litestar.testing import AsyncTestClient

from control_plane.app import create_app
from control_plane.auth import token_id
from control_plane.settings import ControlPlaneSettings
from tests.control_plane.artifacts.helpers import files_of
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
    assert {e["actor"] for e in page["data"]} == {f"admin:{token_id(ADMIN)}", f"read:{token_id(READ)}"}
    assert ADMIN not in str(page) and READ not in str(page)

    second = await events(client, limit=2, offset=2)
    assert second["total"] == 5 and [e["id"] for e in second["data"]] == [e["id"] for e in page["data"][2:4]]
    assert [e["target"] for e in (await events(client, adapter="a"))["data"]] == ["a@1", "a", "a"]
    assert [e["target"] for e in (await events(client, adapter="a_"))["data"]] == []
    assert (await events(client, actor=f"read:{token_id(READ)}"))["total"] == 1
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


async def test_actors_are_role_and_name(settings: ControlPlaneSettings, demo: dict) -> None:
    """`name=token` entries name their token: the trail says `admin:ops`, never the token or a bare hash;
    an engine token acts as `engine:<its name>`, a tenant key as `tenant:<tenant>/<key name>`."""
    named = dataclasses.replace(settings, admin_tokens=("ops=ops-secret-token", ADMIN),
                                read_tokens=("auditor=reader-secret-token",),
                                engine_credentials={"e1": "engine-secret-token"})
    async with AsyncTestClient(app=create_app(named)) as client:
        ops = {"Authorization": "Bearer ops-secret-token"}
        r = await client.post("/v1/load_lora_adapter", headers=ops, json={
            "lora_name": "by-ops", "lora_path": str(demo["demo-poet"]), "base_model": "demo"})
        assert r.status_code == 200, r.text
        await load(client, "by-bare", demo["demo-short"])
        r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "by-ops"},
                              headers={"Authorization": "Bearer reader-secret-token"})
        assert r.status_code == 403
        r = await client.post("/v1/tenants", headers=ops, json={"name": "team-a"})
        assert r.status_code == 201, r.text
        r = await client.post("/v1/tenants/team-a/keys", headers=ops, json={"name": "ci", "scopes": ["admin:team-a"]})
        assert r.status_code == 201, r.text
        parts = [("files", (n, data, "application/octet-stream")) for n, data in files_of(demo["demo-poet"]).items()]
        r = await client.post("/v1/lora_adapters/by-key/versions", files=parts, data={"base_model": "demo"},
                              headers={"Authorization": f"Bearer {r.json()['key']}"})
        assert r.status_code == 200, r.text
        # last: nothing listens there, and a push to it would fail
        r = await client.post("/v1/engines/register", headers={"Authorization": "Bearer engine-secret-token"},
                              json={"name": "e1", "url": "http://127.0.0.1:1", "base_model": "demo"})
        assert r.status_code == 200, r.text
        page = (await client.get("/v1/audit", headers=ops)).json()
        actors = {(e["action"], e["actor"]) for e in page["data"]}
        assert ("load_lora_adapter", "admin:ops") in actors
        assert ("load_lora_adapter", f"admin:{token_id(ADMIN)}") in actors
        assert ("unload_lora_adapter", "read:auditor") in actors
        assert {("register_engine", "engine:e1"), ("create_tenant", "admin:ops"),
                ("upload_lora_adapter", "tenant:team-a/ci")} <= actors, actors
        assert "secret" not in str(page) and "hidden" not in str(page)
        version = (await client.get("/v1/lora_adapters/by-ops", headers=ops)).json()["versions"][0]
        assert version["created_by"] == "admin:ops"
        assert (await client.get("/v1/audit", params={"actor": "admin:ops"}, headers=ops)).json()["total"] >= 3
