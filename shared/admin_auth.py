"""The admin check of an engine's admin API, and of `loraplane agent`'s, which the control plane calls alike.

`Authorization: Bearer <token>` against the configured admin token (for an engine of a fleet, its own
token: control_plane/engine_tokens.py). No token configured: open. Missing or not a bearer token: 401;
wrong: 403. The comparison is constant-time; neither token is ever logged or echoed.
"""

from __future__ import annotations

import hmac

from shared.errors import AuthenticationError, PermissionDeniedError


def check_admin(authorization: str | None, admin_token: str | None) -> None:
    if not admin_token:
        return
    scheme, _, offered = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not offered.strip():
        raise AuthenticationError(
            "This endpoint needs an admin token: send `Authorization: Bearer <token>` "
            "(the engine's --admin-token, LORAPLANE_ADMIN_TOKEN)."
        )
    if not hmac.compare_digest(offered.strip().encode(), admin_token.encode()):
        raise PermissionDeniedError("The admin token is not valid.")
