"""App-wide behaviour: health, metrics, the OpenAPI document, the auth matrix and the error shape."""

from __future__ import annotations

import pytest
from litestar.testing import AsyncTestClient

from control_plane.auth import token_id
from tests.control_plane.conftest import ADMIN, READ, admin, reader
from tests.control_plane.domain.adapters.helpers import audit


async def test_health_and_metrics_need_no_token(client: AsyncTestClient) -> None:
    assert (await client.get("/health")).json() == {"status": "ok", "tenancy": {"enforced": False, "routers": []}}
    await client.get("/v1/lora_adapters", headers=reader())
    body = (await client.get("/metrics")).text
    assert 'loraplane_control_requests_total{method="GET",route="/v1/lora_adapters",status="200"} 1.0' in body


async def test_openapi_lists_every_handler_with_operation_id_and_description(client: AsyncTestClient) -> None:
    doc = (await client.get("/schema/openapi.json")).json()
    ops = [op for path in doc["paths"].values() for op in path.values()]
    assert {op["operationId"] for op in ops} >= {
        "health", "loadLoraAdapter", "unloadLoraAdapter", "listLoraAdapters", "getLoraAdapter",
        "activateLoraAdapter", "deleteLoraAdapter", "resolveLoraAdapter", "registerEngine", "engineHeartbeat", "drainEngine",
        "listEngines", "deleteEngine", "reconcileEngines", "loraStats"}
    assert all(op.get("description") or op.get("summary") for op in ops)


MUTATIONS = [
    ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"}),
    ("POST", "/v1/lora_adapters/x/activate", {"version": 1}),
    ("DELETE", "/v1/lora_adapters/x", None),
]
READS = [("GET", "/v1/lora_adapters", None), ("GET", "/v1/lora_adapters/x", None)]


@pytest.mark.parametrize(("method", "path", "body"), MUTATIONS + READS)
async def test_auth_matrix(client: AsyncTestClient, settings, method: str, path: str, body: dict | None) -> None:
    async def call(headers: dict[str, str]) -> int:
        r = await client.request(method, path, json=body, headers=headers)
        if r.status_code in (401, 403):
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert ADMIN not in r.text and READ not in r.text
        return r.status_code

    mutating = (method, path, body) in MUTATIONS
    assert await call({}) == 401
    assert await call({"Authorization": "Bearer not-a-token"}) == 401
    assert await call({"Authorization": f"Basic {ADMIN}"}) == 401
    assert await call(reader()) == (403 if mutating else (200 if path == "/v1/lora_adapters" else 404))
    assert await call(admin()) not in (401, 403)  # past auth: the call's own outcome (400/404)
    outcomes = [outcome for _, _, outcome in await audit(settings.database_url)]
    # anonymous and unknown tokens leave no row; a read token's attempt at a mutation does, as does the
    # admin's (refused by the service: no such adapter, or no such path)
    assert outcomes == (["403 permission_error", outcomes[-1]] if mutating else [])


async def test_errors_are_openai_shaped(client: AsyncTestClient) -> None:
    r = await client.get("/no/such/route")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = await client.post("/v1/load_lora_adapter", json={"lora_name": "bad name!", "lora_path": "/x"},
                          headers=admin())
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error" and "lora_name" in r.text


def test_token_id_is_a_short_hash() -> None:
    assert len(token_id(ADMIN)) == 12 and ADMIN not in token_id(ADMIN)
