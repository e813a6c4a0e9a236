"""Admin authentication: mutating endpoints need `Authorization: Bearer <admin token>` when one is set.

No token configured → open (a single-user dev engine). 401 when the header is missing or not a
bearer token, 403 when the token is wrong. The comparison is constant-time, and neither the
expected nor the offered token is ever logged or echoed.
"""

from __future__ import annotations

import hmac

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from shared.errors import AuthenticationError, PermissionDeniedError


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


def admin_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Litestar guard for the admin endpoints."""
    check_admin(connection.headers.get("authorization"), connection.app.state.config.admin_token)
