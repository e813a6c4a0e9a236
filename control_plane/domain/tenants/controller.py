"""HTTP surface of tenants: thin handlers, one service call each.

/v1/tenants: tenants and their keys (an admin token for everything; a tenant key with `admin:<tenant>`
for its own tenant's reads and keys). /v1/tenancy: what routers read (a key's record by id, who may use
which adapter) and who owns an adapter (set with an admin token: moving adapters between tenants).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from litestar import Controller, Request, Response, delete, get, patch, post, put, route
from litestar.datastructures import State
from litestar.di import Provide
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.auth import (
    Principal,
    admin_guard,
    provide_principal,
    read_guard,
    router_guard,
    router_only_guard,
)
from control_plane.domain.tenants import schemas
from control_plane.domain.tenants.service import TenantService
from control_plane.uow import Mutation
from shared.names import AdapterName
from shared.openapi import decode_body, options_response, route_doc
from shared.tenants import (
    ACCESS_PATH,
    KEYS_PATH,
    REHASH_SUFFIX,
    AccessTable,
    KeyRecord,
    RehashRequest,
    TenantName,
)

_TENANT_ROLE = {"tenant_role": "tenant"}  # a tenant key with admin:<tenant> may call it for its own tenant
_TENANT = {"tenant": TenantName}
KeyId = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{12}$")]


async def provide_tenant_service(db_session: AsyncSession, state: State) -> TenantService:
    return TenantService(db_session, Mutation(db_session, state.write_gate, state.metrics), state.revocations,
                         state.tenant_auth)


class TenantController(Controller):
    path = "/v1/tenants"
    tags = ["tenants"]
    guards = [read_guard]
    dependencies = {"service": Provide(provide_tenant_service), "principal": Provide(provide_principal)}

    @route(["/", "/{tenant:str}", "/{tenant:str}/keys", "/{tenant:str}/keys/{key_id:str}", "/{tenant:str}/adapters"],
           http_method="OPTIONS", include_in_schema=False)
    async def _options(self, request: Request[Any, Any, Any]) -> Response[None]:
        """The methods documented for the path (GET and POST of one path are two handlers here). Named to
        sort first: Litestar gives the first handler registered on a path its own OPTIONS, which wins."""
        return options_response(request)

    @post("/", status_code=201, guards=[admin_guard], operation_id="createTenant",
          opt={"audit_action": "create_tenant",
               **route_doc(request=schemas.TenantCreate, response=schemas.TenantChanged, status=201, errors=(400, 409, 413),
                           example={"name": "team-a", "display_name": "Team A",
                                    "limits": {"requests_per_minute": 600, "tokens_per_minute": 100000,
                                               "concurrent_requests": 16, "adapters": 20},
                                    "sources": ["/srv/adapters/team-a", "s3://models/team-a/"]})})
    async def create(self, service: TenantService, principal: Principal,
                     request: Request[Any, Any, Any]) -> schemas.TenantChanged:
        """Create a tenant with its quotas (requests and tokens per minute, concurrent requests, adapters
        owned; a quota left out is unlimited) and its `sources`, the folder and URL prefixes its admin
        keys may load from (none: they may only upload files). 409 when the name is taken. `warnings` says
        when no router enforces tenant keys (its quotas then apply to no client yet)."""
        return await service.create(decode_body(await request.body(), schemas.TenantCreate), principal)

    @get("/", operation_id="listTenants", opt=route_doc(response=schemas.TenantPage))
    async def list_tenants(self, service: TenantService) -> schemas.TenantPage:
        """Every tenant with its quotas, the adapters it owns and its keys not revoked, by name."""
        return await service.list()

    @get("/{tenant:str}", operation_id="getTenant",
         opt={**_TENANT_ROLE, **route_doc(response=schemas.Tenant, errors=(404,), path_params=_TENANT)})
    async def get_tenant(self, service: TenantService, tenant: str) -> schemas.Tenant:
        """One tenant."""
        return await service.get(tenant)

    @patch("/{tenant:str}", guards=[admin_guard], operation_id="updateTenant",
           opt={"audit_action": "update_tenant",
                **route_doc(request=schemas.TenantUpdate, response=schemas.TenantChanged, errors=(400, 404, 413),
                            path_params=_TENANT, example={"limits": {"requests_per_minute": 60}})})
    async def update(self, service: TenantService, principal: Principal, tenant: str,
                     request: Request[Any, Any, Any]) -> schemas.TenantChanged:
        """Set a tenant's display name, quotas (`limits` replaces them all) and/or `sources` (replaced
        too; an admin token only, as every change here); routers apply new quotas within their key cache
        TTL (at once where Redis carries the change), new sources hold from the next load. `warnings` says
        when no router enforces tenant keys (its quotas then apply to no client yet)."""
        return await service.update(tenant, decode_body(await request.body(), schemas.TenantUpdate), principal)

    @post("/{tenant:str}/keys", status_code=201, guards=[admin_guard], operation_id="createApiKey",
          opt={"audit_action": "create_api_key", **_TENANT_ROLE,
               **route_doc(request=schemas.ApiKeyCreate, response=schemas.ApiKeyCreated, status=201,
                           errors=(400, 404, 413), path_params=_TENANT,
                           example={"name": "ci", "scopes": ["inference"], "limits": {"requests_per_minute": 60}})})
    async def create_key(self, service: TenantService, principal: Principal, tenant: str,
                         request: Request[Any, Any, Any]) -> Response[schemas.ApiKeyCreated]:
        """Create a key for the tenant: `key` (`lp_<key id>_<secret>`) is in this answer and nowhere else,
        ever (only its HMAC under the server's pepper is kept; 503 without LORAPLANE_KEY_PEPPER). Scopes:
        `inference` (the router) and/or `admin:<tenant>` (this control plane, on the tenant's own adapters
        and keys). `warnings` says when no router enforces tenant keys (the key's quotas then apply to no
        client yet)."""
        created = await service.create_key(tenant, decode_body(await request.body(), schemas.ApiKeyCreate), principal)
        return Response(created, status_code=201, headers={"Cache-Control": "no-store"})

    @get("/{tenant:str}/keys", operation_id="listApiKeys",
         opt={**_TENANT_ROLE, **route_doc(response=schemas.ApiKeyPage, errors=(404,), path_params=_TENANT)})
    async def list_keys(self, service: TenantService, tenant: str) -> schemas.ApiKeyPage:
        """The tenant's keys (ids, names, scopes, quotas, expiry, last use, revocation), never a secret."""
        return await service.list_keys(tenant)

    @delete("/{tenant:str}/keys/{key_id:str}", status_code=200, guards=[admin_guard], operation_id="revokeApiKey",
            opt={"audit_action": "revoke_api_key", **_TENANT_ROLE,
                 **route_doc(response=schemas.ApiKey, errors=(404,), path_params={**_TENANT, "key_id": KeyId})})
    async def revoke_key(self, service: TenantService, principal: Principal, tenant: str,
                         key_id: str) -> schemas.ApiKey:
        """Revoke a key (idempotent): routers refuse it within 5 s (their key cache TTL; at once where Redis
        carries the revocation), this control plane at once."""
        return await service.revoke_key(tenant, key_id, principal)

    @get("/{tenant:str}/adapters", operation_id="listTenantAdapters",
         opt={**_TENANT_ROLE, **route_doc(response=AccessTable, errors=(404,), path_params=_TENANT)})
    async def adapters(self, service: TenantService, tenant: str) -> AccessTable:
        """The adapters the tenant owns, by name, and whether each is public."""
        return await service.tenant_adapters(tenant)


class TenancyController(Controller):
    path = "/v1/tenancy"
    tags = ["tenants"]
    dependencies = {"service": Provide(provide_tenant_service), "principal": Provide(provide_principal)}

    @get(KEYS_PATH.removeprefix("/v1/tenancy") + "/{key_id:str}", guards=[router_only_guard],
         operation_id="getApiKeyRecord",
         opt=route_doc(response=KeyRecord, errors=(404,), path_params={"key_id": KeyId}))
    async def key_record(self, service: TenantService, key_id: str) -> KeyRecord:
        """What a router needs to check a key: tenant, scopes, expiry, revocation, the key's and the
        tenant's quotas and the secret's hash (HMAC, or a legacy argon2 one; a router or admin token only)."""
        return await service.key_record(key_id)

    @post(KEYS_PATH.removeprefix("/v1/tenancy") + "/{key_id:str}" + REHASH_SUFFIX, guards=[router_only_guard],
          status_code=200, operation_id="rehashApiKey",
          opt=route_doc(request=RehashRequest, response=KeyRecord, errors=(400, 404, 413),
                        path_params={"key_id": KeyId}, example={"key": "lp_0123456789ab_" + "x" * 43}))
    async def rehash(self, service: TenantService, key_id: str, request: Request[Any, Any, Any]) -> KeyRecord:
        """A router verified `key` against its legacy (argon2) hash: the control plane checks it against the
        stored hash itself and rewrites that as HMAC under its pepper (compare-and-set on the old hash;
        idempotent), answering the key's record with the new hash. 400 when `key` is not this key's (a
        failed attempt, counted per key id and per address like a tenant key's: 429 past the limits);
        503 without LORAPLANE_KEY_PEPPER (a router or admin token only)."""
        body = decode_body(await request.body(), RehashRequest)
        return await service.rehash_key(key_id, body, request.client.host if request.client else "")

    @route([KEYS_PATH.removeprefix("/v1/tenancy") + "/{key_id:str}",
            KEYS_PATH.removeprefix("/v1/tenancy") + "/{key_id:str}" + REHASH_SUFFIX,
            ACCESS_PATH.removeprefix("/v1/tenancy"), ACCESS_PATH.removeprefix("/v1/tenancy") + "/{name:path}"],
           http_method="OPTIONS", include_in_schema=False)
    async def _options(self, request: Request[Any, Any, Any]) -> Response[None]:
        """The methods documented for the path (see TenantController._options)."""
        return options_response(request)

    @get(ACCESS_PATH.removeprefix("/v1/tenancy"), guards=[router_guard], operation_id="getAdapterAccess",
         opt=route_doc(response=AccessTable))
    async def access(self, service: TenantService) -> AccessTable:
        """Every adapter's owner tenant (null: nobody's) and whether it is public: which keys may use it."""
        return await service.access_table()

    @put(ACCESS_PATH.removeprefix("/v1/tenancy") + "/{name:path}", guards=[admin_guard],
         operation_id="setAdapterAccess",
         opt={"audit_action": "set_adapter_access",
              **route_doc(request=schemas.AdapterAccessUpdate, response=schemas.AdapterAccessChanged, errors=(400, 404, 409, 413),
                          path=ACCESS_PATH + "/{name}", path_params={"name": AdapterName},
                          example={"owner": "team-a", "public": False})})
    async def set_access(self, service: TenantService, principal: Principal, name: str,
                         request: Request[Any, Any, Any]) -> schemas.AdapterAccessChanged:
        """Move an adapter to a tenant (`owner`; null: nobody's) and/or make it public to every tenant.
        409 when the new owner already owns its adapters quota. `warnings` says when no router enforces
        tenant keys (a private adapter is then still served to every client)."""
        return await service.set_access(name.lstrip("/"), decode_body(await request.body(), schemas.AdapterAccessUpdate),
                                        principal)
