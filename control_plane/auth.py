"""Bearer-token auth: reads need a read or admin token, mutating calls an admin token.

401 without a (known) token, 403 with a read token on a mutating call. Every configured token is compared
in constant time, all of them each time, so timing tells neither which token nor how much of it matched.
The audit trail names a caller by `token_id` (a short sha256 prefix), never by the token itself.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Literal

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from control_plane import audit
from control_plane.settings import ControlPlaneSettings
from shared.errors import AuthenticationError, PermissionDeniedError

Kind = Literal["admin", "read"]


@dataclass(frozen=True)
class Principal:
    kind: Kind
    token_id: str


def token_id(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:12]


def authenticate(authorization: str | None, settings: ControlPlaneSettings) -> Principal:
    scheme, _, offered = (authorization or "").strip().partition(" ")
    offered = offered.strip()
    if scheme.lower() != "bearer" or not offered:
        raise AuthenticationError("This endpoint needs a token: send `Authorization: Bearer <token>`.")
    kind: Kind | None = None
    for candidate_kind, tokens in (("admin", settings.admin_tokens), ("read", settings.read_tokens)):
        for token in tokens:
            if hmac.compare_digest(offered.encode(), token.encode()) and kind is None:
                kind = candidate_kind  # type: ignore[assignment]
    if kind is None:
        raise AuthenticationError("The token is not valid.")
    return Principal(kind=kind, token_id=token_id(offered))


def principal_of(connection: ASGIConnection) -> Principal:
    """Authenticate once per request; guards and the `principal` dependency share the result."""
    cached = connection.scope.get("state", {}).get("loraplane_principal")
    if cached is None:
        cached = authenticate(connection.headers.get("authorization"), connection.app.state.settings)
        connection.scope.setdefault("state", {})["loraplane_principal"] = cached
    return cached


def read_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Any valid token (read or admin)."""
    principal_of(connection)


async def admin_guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    """An admin token; a read token gets 403, and the attempt is audited (anonymous 401s are not: they
    would let anyone fill the table)."""
    principal = principal_of(connection)
    if principal.kind == "admin":
        return
    state = connection.app.state
    action = handler.opt.get("audit_action", handler.operation_id or connection.url.path)
    async with state.audit_sessions() as session:
        row = audit.event(principal.token_id, action, connection.url.path, "403 permission_error")
        await audit.record_alone(session, state.write_gate, row)
    raise PermissionDeniedError("This call changes state and needs an admin token; this is a read token.")


async def provide_principal(request: ASGIConnection) -> Principal:
    return principal_of(request)
