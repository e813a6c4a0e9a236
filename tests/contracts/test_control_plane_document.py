"""The control plane's OpenAPI document, in process: what the schemathesis run relies on, pinned by
fast tests (each would fail on the document and handlers before the contract work).

- every operation has an operationId, a description and a typed 200 body; guarded ones document
  401/403/503 with the error schema; pushes document 207/502 with their own body, not an error;
- the `{name:path}` routes are documented at the paths they serve (`…/{name}/activate`,
  `…/{name}/heartbeat`, `…/{name}/drain`), and OPTIONS lists exactly the methods documented there;
- bodies are decoded as strictly as documented (`0` is no boolean), and integers the database cannot
  hold are 400s, not 500s.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient

from control_plane.app import create_app
from control_plane.settings import ControlPlaneSettings

TOKEN = "contract-document-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[AsyncTestClient]:
    settings = ControlPlaneSettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'cp.db'}", admin_tokens=(TOKEN,),
                                    adapter_roots=(str(tmp_path),))
    async with AsyncTestClient(app=create_app(settings)) as c:
        yield c


async def _document(client: AsyncTestClient) -> dict:
    return (await client.get("/schema/openapi.json")).json()


async def test_every_operation_is_typed_and_documents_its_statuses(client: AsyncTestClient) -> None:
    doc = await _document(client)
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            where = f"{method.upper()} {path}"
            assert op.get("operationId") and op.get("description"), where
            success = "201" if method == "post" and "201" in op["responses"] else "200"  # a create: 201
            content = op["responses"][success]["content"]
            if path == "/v1/artifacts/{digest}/{name}":  # a file's bytes, as they are
                assert content == {"application/octet-stream": {"schema": {"type": "string"}}}, where
                assert "206" in op["responses"] and "416" in op["responses"], where
            else:
                assert content["application/json"]["schema"].get("$ref"), where  # a named Struct, not a guess
            if path != "/health":
                for status in ("401", "403", "503"):
                    assert op["responses"][status]["content"]["application/json"]["schema"] == error, where
    load = doc["paths"]["/v1/load_lora_adapter"]["post"]["responses"]
    for status in ("200", "207", "502"):
        assert load[status]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/AdapterLoaded"}
    assert load["400"]["content"]["application/json"]["schema"] == error


async def test_path_routes_are_documented_where_they_serve(client: AsyncTestClient) -> None:
    paths = (await _document(client))["paths"]
    assert "/v1/lora_adapters/{target}" not in paths and "/v1/engines/{target}" not in paths
    assert set(paths["/v1/lora_adapters/{name}"]) == {"get", "patch", "delete"}
    assert set(paths["/v1/lora_adapters/{name}/activate"]) == {"post"}
    beat, drain = paths["/v1/engines/{name}/heartbeat"]["post"], paths["/v1/engines/{name}/drain"]["post"]
    assert (beat["operationId"], drain["operationId"]) == ("engineHeartbeat", "drainEngine")
    assert beat["requestBody"]["required"] is False and "requestBody" not in drain
    name = paths["/v1/lora_adapters/{name}"]["get"]["parameters"][0]
    assert name["in"] == "path" and name["schema"]["pattern"]  # the adapter name rule


@pytest.mark.parametrize(("path", "allow"), [
    ("/v1/lora_adapters/org/a/activate", "OPTIONS, POST"),
    ("/v1/lora_adapters/org/a", "OPTIONS, GET, DELETE, PATCH"),
    ("/v1/engines/e1/heartbeat", "OPTIONS, POST"),
    ("/v1/engines/e1/drain", "OPTIONS, POST"),
    ("/v1/engines/e1", "OPTIONS, DELETE"),
])
async def test_options_lists_the_methods_documented_for_the_path(client: AsyncTestClient, path: str,
                                                                  allow: str) -> None:
    r = await client.options(path, headers=AUTH)
    assert r.status_code == 204 and r.headers["allow"] == allow


@pytest.mark.parametrize(("method", "path", "body", "param"), [
    ("POST", "/v1/engines/e1/heartbeat", {"draining": 0}, "draining"),  # Litestar took 0 as false
    ("POST", "/v1/engines/register", {"name": "e1", "url": "http://10.0.0.1:8000", "base_model": "m",
                                      "slots_total": "4"}, "slots_total"),
    ("POST", "/v1/lora_adapters/x/activate", {"version": 2**70}, "version"),  # was a 500
    ("POST", "/v1/lora_adapters/x/activate", {"version": True}, "version"),
])
async def test_bodies_are_decoded_as_strictly_as_documented(client: AsyncTestClient, method: str, path: str,
                                                            body: dict, param: str) -> None:
    r = await client.request(method, path, json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_documented_integers_are_accepted_as_json_schema_counts_them(client: AsyncTestClient) -> None:
    r = await client.post("/v1/lora_adapters/x/activate", json={"version": 1.0}, headers=AUTH)
    assert r.status_code == 404, r.text  # past decoding: no adapter x


@pytest.mark.parametrize("query", ["offset=357719765597114073088", "label=" + "k" * 321, "base_model=" + "m" * 257])
async def test_listing_parameters_out_of_range_are_400s(client: AsyncTestClient, query: str) -> None:
    r = await client.get(f"/v1/lora_adapters?{query}", headers=AUTH)
    assert r.status_code == 400, r.text  # the offset was a 500 (the database's integer overflowed)
