"""Authentication. Admin: mutating endpoints need `Authorization: Bearer <admin token>` when one is set.
Inference (--api-key, vLLM's flag): chat, completions and models need `Bearer <api key>` when set.

No token configured → open (a single-user dev engine). 401 when the header is missing or not a
bearer token, 403 when the admin token is wrong (a wrong API key is a 401, as OpenAI answers). The comparison is constant-time, and neither the
expected nor the offered token is ever logged or echoed.
"""

from __future__ import annotations

import hmac
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from shared.errors import AuthenticationError, LoraplaneError, PermissionDeniedError


def check_admin(authorization: str | None, admin_token: str | None) -> None:
    if not admin_token:
        return
    scheme, _, offered = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not offered.strip():
        raise AuthenticationError(
            "This endpoint needs an admin token: send `Authorization: Bearer <token>` "
            "(the engine's --admin-token)."
        )
    if not hmac.compare_digest(offered.strip().encode(), admin_token.encode()):
        raise PermissionDeniedError("The admin token is not valid.")


def check_api_key(authorization: str | None, api_key: str | None) -> None:
    """The inference endpoints with --api-key: 401 in OpenAI's shape for a missing or wrong key."""
    if not api_key:
        return
    scheme, _, offered = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(offered.strip().encode(), api_key.encode()):
        raise AuthenticationError(
            "Missing or incorrect API key: send `Authorization: Bearer <key>` (the engine's --api-key).",
            code="invalid_api_key",
        )


# The guards are coroutines though they never wait: Litestar runs a plain function guard on a worker
# thread (anyio.to_thread), a thread hop and a GIL hand-off on every request for a string compare.
async def api_key_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Litestar guard for the inference endpoints (chat, completions, models)."""
    check_api_key(connection.headers.get("authorization"), connection.app.state.config.api_key)


def is_admin(connection: ASGIConnection[Any, Any, Any, Any]) -> bool:
    """Whether the caller passes the admin check (always, on an engine without an admin token): what
    decides who sees where adapter and model files lie on the engine's disk."""
    try:
        check_admin(connection.headers.get("authorization"), connection.app.state.config.admin_token)
    except LoraplaneError:
        return False
    return True


async def admin_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Litestar guard for the admin endpoints."""
    check_admin(connection.headers.get("authorization"), connection.app.state.config.admin_token)
