"""Each engine's admin token, derived from one configured secret.

The control plane calls engine NAME with `engine_admin_token(secret, NAME)`:
base64url without padding of HMAC-SHA256(secret, "loraplane engine admin token:" + NAME). An engine is
started with its own token as `--admin-token` (`loraplane engines token NAME` prints it), so whatever a
registration's URL points at receives a token that only engine NAME accepts, never the secret.

The secret is LORAPLANE_ENGINE_ADMIN_TOKEN (or the file LORAPLANE_ENGINE_ADMIN_TOKEN_FILE names; the
deprecated LORAPLANE_ENGINE_TOKEN likewise). This module imports nothing of the server side: the admin CLI
derives tokens with it locally.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping

from shared.secret_env import read_secret

ENGINE_SECRET_ENV = "LORAPLANE_ENGINE_ADMIN_TOKEN"
ENGINE_SECRET_OLD_ENV = "LORAPLANE_ENGINE_TOKEN"  # its deprecated name
_CONTEXT = b"loraplane engine admin token:"


def engine_admin_token(secret: str, engine: str) -> str:
    """Engine `engine`'s admin token under `secret` (43 characters of base64url)."""
    digest = hmac.new(secret.encode(), _CONTEXT + engine.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def engine_secret_from(env: Mapping[str, str]) -> str | None:
    """The configured secret: its variable, else its file, else the deprecated name's; None when unset.
    ValueError names an unreadable file, never a value."""
    return read_secret(env, ENGINE_SECRET_ENV) or read_secret(env, ENGINE_SECRET_OLD_ENV)
