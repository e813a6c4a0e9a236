"""A tenant key's `s3://` and `hf://` loads: read with the control plane's own credentials and network, so
only under a URL prefix of its tenant's sources (scheme, host, then whole path segments), refused (403)
before any request otherwise, and refused (400) when the URL would step out of its prefix (`..`, an
encoded `/`, empty segments, credentials). SQLite only: the rule does not depend on the database (the
tenants tests run on both)."""

from __future__ import annotations

from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient

from tests.control_plane.artifacts.conftest import S3, Hub
from tests.control_plane.artifacts.helpers import files_of
from tests.control_plane.conftest import admin
from tests.control_plane.domain.tenants.helpers import bearer, make_key, make_tenant


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'control.db'}"


async def team_a(client: AsyncTestClient, *sources: str) -> dict[str, str]:
    await make_tenant(client, "team-a", sources=list(sources) or None)
    return bearer(await make_key(client, "team-a", "admin:team-a"))


async def load(client: AsyncTestClient, key: dict[str, str], name: str, lora_path: str) -> tuple[int, dict]:
    r = await client.post("/v1/load_lora_adapter", headers=key,
                          json={"lora_name": name, "lora_path": lora_path, "base_model": "demo"})
    return r.status_code, r.json()


async def test_s3_loads_only_under_the_tenants_prefix(client: AsyncTestClient, demo: dict, s3: S3) -> None:
    for folder in ("team-a/poet", "team-b/private", "team-ab/x"):
        for name, data in files_of(demo["demo-poet"]).items():
            s3.put(f"{folder}/{name}", data)
    key = await team_a(client)
    status, body = await load(client, key, "a-copy", f"{s3.url}/team-b/private/")  # the control plane's credentials
    assert status == 403 and "has no sources" in body["error"]["message"], body
    r = await client.patch("/v1/tenants/team-a", json={"sources": [f"{s3.url}/team-a/"]}, headers=admin())
    assert r.status_code == 200, r.text
    status, body = await load(client, key, "a-poet", f"{s3.url}/team-a/poet")
    assert status == 200 and body["created"], body
    for lora_path in (f"{s3.url}/team-b/private/", f"{s3.url}/team-ab/x/", f"{s3.url}/team-", f"{s3.url}/",
                      f"s3://other-bucket/{s3.prefix}/team-a/poet", f"gs://artifacts/{s3.prefix}/team-a/poet"):
        status, body = await load(client, key, "a-copy", lora_path)
        assert status == 403 and "not under any source of tenant 'team-a'" in body["error"]["message"], (lora_path, body)
    for lora_path in (f"{s3.url}/team-a/../team-b/private", f"{s3.url}/team-a/%2E%2E/team-b/private",
                      f"{s3.url}/team-a%2F..%2Fteam-b/private", f"{s3.url}/team-a//poet",
                      f"s3://key:secret@artifacts/{s3.prefix}/team-a/poet", f"{s3.url}/team-a/poet?x=1", "s3://[artifacts/x"):
        status, body = await load(client, key, "a-copy", lora_path)
        assert status == 400 and body["error"]["param"] == "lora_path", (lora_path, body)
        assert "secret" not in str(body)
    detail = (await client.get("/v1/lora_adapters/a-copy", headers=key)).json()
    assert detail["error"]["type"] == "not_found_error"


async def test_hf_loads_only_the_tenants_repositories_and_revisions(client: AsyncTestClient, hub: Hub) -> None:
    nothing = await team_a(client)
    status, body = await load(client, nothing, "a-hub", "hf://org/poet")
    assert status == 403 and "has no sources" in body["error"]["message"], body
    r = await client.patch("/v1/tenants/team-a", json={"sources": ["hf://org/poet@v2"]}, headers=admin())
    assert r.status_code == 200, r.text
    for lora_path in ("hf://org/poet", "hf://org/poet@main", "hf://org/other@v2", "hf://org2/poet@v2"):
        status, body = await load(client, nothing, "a-hub", lora_path)
        assert status == 403, (lora_path, body)
    assert hub.asked == []  # nothing was fetched for a refused load
    status, body = await load(client, nothing, "a-hub", "hf://org/poet@v2")
    assert status == 200, body
    assert hub.asked and all(p.startswith("/org/poet/resolve/v2/") for p in hub.asked)
    r = await client.patch("/v1/tenants/team-a", json={"sources": ["hf://org"]}, headers=admin())
    assert r.status_code == 200 and r.json()["sources"] == ["hf://org"], r.text
    status, body = await load(client, nothing, "a-hub", "hf://org/poet")  # any repository of org, main
    assert status == 200 and body["version"] == 2, body
