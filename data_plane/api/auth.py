"""Authentication. Admin: mutating endpoints need `Authorization: Bearer <admin token>` when one is set.
Inference (--api-key, vLLM's flag): chat, completions and models need `Bearer <api key>` when set.
Listings (/v1/lora_adapters, /v1/lora_stats, /v1/models): with --admin-token or --read-token set, they
name every adapter of every tenant, so they need the admin or the read token; /v1/models also takes the
API key (clients list models, as in vLLM). With neither token, they stay open as vLLM's are.

No token configured → open (a single-user dev engine). 401 when the header is missing or not a
bearer token, 403 when the admin token is wrong (a wrong API key is a 401, as OpenAI answers). The comparison is constant-time, and neither the
expected nor the offered token is ever logged or echoed.
"""

from __future__ import annotations

import hmac
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from data_plane.config import EngineConfig
from shared.admin_auth import check_admin
from shared.errors import AuthenticationError, LoraplaneError, PermissionDeniedError


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


def _offered(authorization: str | None) -> str | None:
    scheme, _, offered = (authorization or "").strip().partition(" ")
    return offered.strip() if scheme.lower() == "bearer" and offered.strip() else None


def _matches(offered: str, *tokens: str | None) -> bool:
    # every token is compared (no early exit), each in constant time
    return sum(hmac.compare_digest(offered.encode(), t.encode()) for t in tokens if t) > 0


def check_listing(authorization: str | None, config: EngineConfig, *, api_key_too: bool = False) -> None:
    """A listing's guard: open on an engine with neither --admin-token nor --read-token (then /v1/models
    is guarded by --api-key alone, as before); otherwise the admin or read token (or, `api_key_too`,
    the API key). Missing: 401. Wrong: 403, or 401 on /v1/models, as OpenAI answers a wrong key."""
    readers = (config.admin_token, config.read_token)
    if not any(readers):
        if api_key_too:
            check_api_key(authorization, config.api_key)
        return
    accepted = (*readers, config.api_key) if api_key_too else readers
    offered = _offered(authorization)
    if offered is not None and _matches(offered, *accepted):
        return
    flags = "the engine's --read-token or --admin-token" + (", or its --api-key" if api_key_too and config.api_key else "")
    if offered is None:
        raise AuthenticationError(f"This listing needs a token: send `Authorization: Bearer <token>` ({flags}).")
    if api_key_too:
        raise AuthenticationError(f"The token is not valid for this listing: send {flags}.", code="invalid_api_key")
    raise PermissionDeniedError(f"The token is not valid for this listing: send {flags}.")


# The guards are coroutines though they never wait: Litestar runs a plain function guard on a worker
# thread (anyio.to_thread), a thread hop and a GIL hand-off on every request for a string compare.
async def api_key_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Litestar guard for the inference endpoints (chat, completions, models)."""
    check_api_key(connection.headers.get("authorization"), connection.app.state.config.api_key)


async def listing_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Litestar guard for /v1/lora_adapters and /v1/lora_stats."""
    check_listing(connection.headers.get("authorization"), connection.app.state.config)


async def models_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Litestar guard for /v1/models and /v1/models/{model}: the listing's tokens, or the API key."""
    check_listing(connection.headers.get("authorization"), connection.app.state.config, api_key_too=True)


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
