"""Making tenants and their keys through the admin API, as an operator does."""

from __future__ import annotations

from litestar.testing import AsyncTestClient

from tests.control_plane.conftest import admin


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def make_tenant(client: AsyncTestClient, name: str, sources: list[str] | None = None, **limits: int) -> dict:
    body = {"name": name, "display_name": name.title(), "limits": limits}
    if sources is not None:
        body["sources"] = sources
    r = await client.post("/v1/tenants", json=body, headers=admin())
    assert r.status_code == 201, r.text
    return r.json()


async def make_key(client: AsyncTestClient, tenant: str, *scopes: str, headers: dict | None = None) -> str:
    r = await client.post(f"/v1/tenants/{tenant}/keys", json={"name": "k", "scopes": list(scopes or ["inference"])},
                          headers=headers or admin())
    assert r.status_code == 201, r.text
    assert r.headers["cache-control"] == "no-store"
    return r.json()["key"]
