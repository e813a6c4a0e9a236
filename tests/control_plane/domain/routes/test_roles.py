"""Every role against every guarded route: admin, read, engine and router tokens (the router's
credential may read routes, report demand and ask for placement, nothing else).

The policy is written out here, per operation, and must cover every guarded handler of the app, so a
new route without a line here fails the test instead of inheriting a role by accident (a line for a
route the app does not have is skipped). A refusal is a 403 naming the caller's role and leaves an
audit row under the caller's token id; an allowed call gets past the guards (the handler's own
answer: 200, 400, 404 …).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import AsyncIterator

import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient

from control_plane.app import create_app
from control_plane.db.models import AuditEvent
from control_plane.settings import ControlPlaneSettings
from tests.control_plane.conftest import ADMIN, READ
from tests.control_plane.domain.adapters.helpers import fetch_all

ENGINE_TOKEN, ROUTER_TOKEN = "engine-e1-token-for-tests", "router-token-for-tests"
TOKENS = {"admin": ADMIN, "read": READ, "engine": ENGINE_TOKEN, "router": ROUTER_TOKEN}
DIGEST = "0" * 64
# operation id -> (method, path, body, the roles that get past the guards)
POLICY: dict[str, tuple[str, str, dict | None, set[str]]] = {
    "listLoraAdapters": ("GET", "/v1/lora_adapters", None, {"admin", "read"}),
    "getLoraAdapter": ("GET", "/v1/lora_adapters/x", None, {"admin", "read"}),
    "activateOrUpload": ("POST", "/v1/lora_adapters/x/activate", {"version": 1}, {"admin"}),
    "deleteLoraAdapterOrVersion": ("DELETE", "/v1/lora_adapters/x", None, {"admin"}),
    "updateLoraAdapter": ("PATCH", "/v1/lora_adapters/x", {"replicas": {"min": 1}}, {"admin"}),
    "loadLoraAdapter": ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"}, {"admin"}),
    "unloadLoraAdapter": ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"}, {"admin"}),
    "resolveLoraAdapter": ("GET", "/v1/resolve/x?base_model=demo&engine=e1", None, {"admin", "read", "engine"}),
    "registerEngine": ("POST", "/v1/engines/register",
                       {"name": "e1", "url": "http://127.0.0.1:1", "base_model": "demo"}, {"admin", "engine"}),
    "engineHeartbeatOrDrain": ("POST", "/v1/engines/e1/heartbeat", {}, {"admin", "engine"}),
    "listEngines": ("GET", "/v1/engines", None, {"admin", "read"}),
    "deleteEngine": ("DELETE", "/v1/engines/nobody", None, {"admin"}),
    "reconcileEngines": ("POST", "/v1/engines/reconcile", None, {"admin"}),
    "loraStats": ("GET", "/v1/lora_stats", None, {"admin", "read"}),
    "listAuditEvents": ("GET", "/v1/audit", None, {"admin", "read"}),
    "listRouters": ("GET", "/v1/routers", None, {"admin", "read"}),
    "getArtifactManifest": ("GET", f"/v1/artifacts/{DIGEST}", None, {"admin", "read", "engine"}),
    "getArtifactFile": ("GET", f"/v1/artifacts/{DIGEST}/adapter_config.json", None, {"admin", "read", "engine"}),
    "getRoutes": ("GET", "/v1/routes", None, {"admin", "read", "router"}),
    "reportDemand": ("POST", "/v1/routes/demand", {"demand": [{"model": "x", "waiting": 1}], "place": ["x"]},
                     {"admin", "router"}),
    "createTenant": ("POST", "/v1/tenants", {"name": "t"}, {"admin"}),
    "listTenants": ("GET", "/v1/tenants", None, {"admin", "read"}),
    "getTenant": ("GET", "/v1/tenants/t", None, {"admin", "read"}),
    "updateTenant": ("PATCH", "/v1/tenants/t", {"display_name": "T"}, {"admin"}),
    "createApiKey": ("POST", "/v1/tenants/t/keys", {"name": "k"}, {"admin"}),
    "listApiKeys": ("GET", "/v1/tenants/t/keys", None, {"admin", "read"}),
    "revokeApiKey": ("DELETE", "/v1/tenants/t/keys/000000000000", None, {"admin"}),
    "listTenantAdapters": ("GET", "/v1/tenants/t/adapters", None, {"admin", "read"}),
    "getApiKeyRecord": ("GET", "/v1/tenancy/keys/000000000000", None, {"admin", "router"}),  # it holds the hash
    "rehashApiKey": ("POST", "/v1/tenancy/keys/000000000000/rehash", {"key": "lp_000000000000_" + "x" * 43},
                     {"admin", "router"}),
    "getAdapterAccess": ("GET", "/v1/tenancy/adapters", None, {"admin", "read", "router"}),
    "setAdapterAccess": ("PUT", "/v1/tenancy/adapters/x", {"owner": None}, {"admin"}),
}


def guarded_operations(app: Litestar) -> set[str]:
    return {h.operation_id for r in app.routes for h in getattr(r, "route_handlers", ())
            if h.resolve_guards() and h.include_in_schema is not False and h.operation_id}


@pytest.fixture
def role_settings(settings: ControlPlaneSettings) -> ControlPlaneSettings:
    return dataclasses.replace(settings, engine_credentials={"e1": ENGINE_TOKEN}, router_tokens=(ROUTER_TOKEN,))


@pytest.fixture
async def cp(role_settings: ControlPlaneSettings) -> AsyncIterator[AsyncTestClient]:
    async with AsyncTestClient(app=create_app(role_settings)) as c:
        yield c


async def test_the_policy_names_every_guarded_route(cp: AsyncTestClient) -> None:
    assert guarded_operations(cp.app) <= set(POLICY)


@pytest.mark.parametrize("role", list(TOKENS))
async def test_each_role_passes_exactly_its_routes(cp: AsyncTestClient, role_settings, role: str) -> None:
    refused: list[str] = []
    present = guarded_operations(cp.app)
    for operation, (method, path, body, allowed) in POLICY.items():
        if operation not in present:
            continue  # a route of a change not in this tree yet
        r = await cp.request(method, path, json=body, headers={"Authorization": f"Bearer {TOKENS[role]}"})
        if role in allowed:
            assert r.status_code not in (401, 403), (operation, r.status_code, r.text)
            continue
        assert r.status_code == 403, (operation, r.status_code, r.text)
        error = r.json()["error"]
        assert error["type"] == "permission_error", (operation, error)
        assert re.search(rf"this is an? {role} token", error["message"], re.I), (operation, error)
        assert TOKENS[role] not in r.text
        refused.append(operation)
    assert role != "admin" or not refused
    mine = [e for e in await fetch_all(role_settings.database_url, AuditEvent) if e.actor.startswith(f"{role}:")]
    assert sum(e.outcome == "403 permission_error" for e in mine) == len(refused)  # every refusal audited


async def test_an_unknown_token_is_401_everywhere(cp: AsyncTestClient) -> None:
    present = guarded_operations(cp.app)
    for operation, (method, path, body, _) in POLICY.items():
        if operation not in present:
            continue
        r = await cp.request(method, path, json=body, headers={"Authorization": "Bearer router-token-for-test"})
        assert r.status_code == 401, (operation, r.text)
