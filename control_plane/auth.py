"""Bearer-token auth with four roles: admin (everything), read (reads), engine (its own bookkeeping),
router (the routing table and its own demand reports).

- admin tokens (LORAPLANE_ADMIN_TOKENS) may do everything, registering any engine included;
- read tokens (LORAPLANE_READ_TOKENS) may read; a mutating call gets 403;
- an engine token (LORAPLANE_ENGINE_CREDENTIALS, `name=token,…`) acts only for its engine name and only
  on the engine's own calls: register, heartbeat, resolve, drain (`engine_guard` routes, which then call
  `require_engine`). Everywhere else it gets 403: an engine holds no admin token of the control plane,
  so a compromised or impersonated engine cannot load adapters or redirect other engines;
- a router token (LORAPLANE_ROUTER_TOKENS) may read the routing table and report demand (asking for
  placements with it): the `router_guard` routes, nothing else. A router faces clients, so its token is
  the likeliest to leak; it reads no adapter paths or audit trail and changes nothing directly;
- a tenant key (`lp_<key id>_<secret>`, control_plane/domain/tenants) with the scope `admin:<tenant>` acts
  on routes marked `opt={"tenant_role": "adapter" | "tenant"}` only, and there only on its own tenant and
  that tenant's adapters (the app's `tenant_auth.gate`: another tenant's adapter is a 404); elsewhere, and
  for a key without that scope, 403; 429 (without a lookup or hash) past the failed attempts allowed per
  client address and per key id (shared/key_checks.py).

401 without a (known) token. Every configured token is compared in constant time, all of them each time,
so timing tells neither which token nor how much of it matched. The audit trail names a caller by its
`actor`, `role:name`, never by the token itself: `admin:ops` for an admin token given as `ops=<token>`,
`admin:<token id>` (a short sha256 prefix) for one given bare, `engine:<engine name>`,
`tenant:<tenant>/<key name>` for a tenant key.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any, Literal

from litestar.connection import ASGIConnection
from litestar.handlers import HTTPRouteHandler
from litestar.handlers.base import BaseRouteHandler

from control_plane import audit
from control_plane.settings import ControlPlaneSettings
from control_plane.settings import token_id as token_id  # re-exported: callers name it by auth
from shared.errors import AuthenticationError, PermissionDeniedError
from shared.tenants import ADMIN_SCOPE_PREFIX, split_key

Kind = Literal["admin", "read", "engine", "router", "tenant"]


@dataclass(frozen=True)
class Principal:
    kind: Kind
    token_id: str
    engine: str | None = None  # the engine name an engine token is bound to
    tenant: str | None = None  # a tenant key's tenant
    scopes: frozenset[str] = frozenset()  # a tenant key's scopes
    name: str = ""  # who the audit trail says acted (the token's or key's name); empty: the token id

    @property
    def actor(self) -> str:
        """`role:name`, as audit rows and versions' `created_by` name the caller."""
        return f"{self.kind}:{self.name or self.token_id}"

    @property
    def tenant_admin(self) -> bool:
        return self.tenant is not None and ADMIN_SCOPE_PREFIX + self.tenant in self.scopes


def authenticate(authorization: str | None, settings: ControlPlaneSettings) -> Principal:
    scheme, _, offered = (authorization or "").strip().partition(" ")
    offered = offered.strip()
    if scheme.lower() != "bearer" or not offered:
        raise AuthenticationError("This endpoint needs a token: send `Authorization: Bearer <token>`.")
    candidates: list[tuple[Kind, str | None, str]] = [("admin", None, t) for t in settings.admin_tokens]
    candidates += [("read", None, t) for t in settings.read_tokens]
    candidates += [("engine", name, t) for name, t in settings.engine_credentials.items()]
    candidates += [("router", None, t) for t in settings.router_tokens]
    found: tuple[Kind, str | None] | None = None
    for kind, engine, token in candidates:
        if hmac.compare_digest(offered.encode(), token.encode()) and found is None:
            found = (kind, engine)
    if found is None:
        raise AuthenticationError("The token is not valid.")
    kind, engine = found
    offered_id = token_id(offered)
    return Principal(kind=kind, token_id=offered_id, engine=engine,
                     name=engine if engine is not None else settings.token_names.get(offered_id, ""))


async def principal_of(connection: ASGIConnection[Any, Any, Any, Any]) -> Principal:
    """Authenticate once per request; guards and the `principal` dependency share the result. A tenant
    key (`lp_…`) is looked up in the database; any other bearer is compared with the role tokens."""
    cached = connection.scope.get("state", {}).get("loraplane_principal")
    if cached is None:
        authorization = connection.headers.get("authorization")
        scheme, _, offered = (authorization or "").strip().partition(" ")
        tenant_key = split_key(offered.strip()) if scheme.lower() == "bearer" else None
        if tenant_key is not None:
            client = connection.client.host if connection.client else ""
            cached = await connection.app.state.tenant_auth.principal(*tenant_key, client)
        else:
            cached = authenticate(authorization, connection.app.state.settings)
        connection.scope.setdefault("state", {})["loraplane_principal"] = cached
    return cached


async def _refuse(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler, principal: Principal,
                  message: str) -> None:
    """403, audited (anonymous 401s are not: they would let anyone fill the table)."""
    state = connection.app.state
    operation_id = handler.operation_id if isinstance(handler, HTTPRouteHandler) else None
    action = handler.opt.get("audit_action", operation_id or connection.url.path)
    async with state.audit_sessions() as session:
        row = audit.event(principal.actor, action, connection.url.path, "403 permission_error")
        await audit.record_alone(session, state.write_gate, row)
    raise PermissionDeniedError(message)


_ENGINE_ONLY = "This is an engine token: it may only register, heartbeat, resolve and drain its own engine."
_TENANT_ONLY = "This is a tenant key: it may only manage its own tenant's adapters and keys (scope admin:<tenant>)."
_ROUTER_ONLY = "This is a router token: it may only read the routing table and report demand."
_READING = frozenset({"GET", "HEAD"})


async def _refuse_narrow_roles(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler,
                               principal: Principal) -> None:
    """Engine and router tokens are refused outside their own routes (the admin and read guards' rule);
    tenant keys outside routes marked `tenant_role`, and there outside their own tenant."""
    if principal.kind == "engine":
        await _refuse(connection, handler, principal, _ENGINE_ONLY)
    if principal.kind == "router":
        await _refuse(connection, handler, principal, _ROUTER_ONLY)
    if principal.kind == "tenant":
        role = handler.opt.get("tenant_role")
        if role is None or not principal.tenant_admin:
            await _refuse(connection, handler, principal, _TENANT_ONLY)
        await connection.app.state.tenant_auth.gate(connection, role, principal)


async def read_guard(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """A read or admin token; an engine token only on routes marked `opt={"engine_role": True}` (an
    engine's own calls, whose handlers check the name with `require_engine`); never a router token."""
    principal = await principal_of(connection)
    if principal.kind == "engine" and handler.opt.get("engine_role"):
        return
    await _refuse_narrow_roles(connection, handler, principal)


async def admin_guard(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """An admin token; a read, engine or router token gets 403, and the attempt is audited."""
    principal = await principal_of(connection)
    if principal.kind == "admin":
        return
    await _refuse_narrow_roles(connection, handler, principal)
    if principal.kind == "tenant":
        return  # on its own tenant's things (the gate above)
    await _refuse(connection, handler, principal,
                  "This call changes state and needs an admin token; this is a read token.")


async def engine_guard(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """An engine's own mutating calls (with `opt={"engine_role": True}`): an admin or engine token, the
    handler then checking the name with `require_engine`; a read or router token gets 403."""
    principal = await principal_of(connection)
    if principal.kind in ("read", "router", "tenant"):
        await _refuse(connection, handler, principal,
                      f"This call needs an admin token or the engine's own token; this is a {principal.kind} token.")


async def router_guard(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """The router's routes: reading them (GET) takes a router, read or admin token; the others (the
    demand report, which may place adapters) a router or admin token. An engine token gets 403."""
    principal = await principal_of(connection)
    if principal.kind in ("admin", "router"):
        return
    if principal.kind == "engine":
        await _refuse(connection, handler, principal, _ENGINE_ONLY)
    if principal.kind == "tenant":
        await _refuse(connection, handler, principal, _TENANT_ONLY)
    if not (isinstance(handler, HTTPRouteHandler) and handler.http_methods <= _READING):
        await _refuse(connection, handler, principal, "This call needs a router or admin token; this is a read token.")


async def router_only_guard(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """A router's own reads that no other role needs (a key's record with its hash): router or admin."""
    principal = await principal_of(connection)
    if principal.kind not in ("admin", "router"):
        await _refuse(connection, handler, principal, f"This call needs a router or admin token; this is a "
                      f"{principal.kind} {'key' if principal.kind == 'tenant' else 'token'}.")


def require_engine(principal: Principal, name: str) -> None:
    """An engine token acts only for its own name (admin tokens for any)."""
    if principal.kind == "engine" and principal.engine != name:
        raise PermissionDeniedError(f"This engine token belongs to engine {principal.engine!r}, not {name!r}.",
                                    param="name")


async def provide_principal(request: ASGIConnection[Any, Any, Any, Any]) -> Principal:
    return await principal_of(request)
