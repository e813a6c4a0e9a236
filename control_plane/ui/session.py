"""The console's session cookie: who signed in (role and token id, never the token), its CSRF token and
when it ends, signed with HMAC-SHA256 under the settings' `ui_session_secret`.

The token itself is not kept: each request checks that the token id still belongs to a configured admin
or read token, so a token removed from the settings ends its sessions at the next restart.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Literal

from control_plane.auth import Principal, token_id
from control_plane.settings import ControlPlaneSettings

logger = logging.getLogger(__name__)

COOKIE = "loraplane_console"
MAX_AGE_S = 8 * 3600
Role = Literal["admin", "read"]


@dataclass(frozen=True)
class ConsoleSession:
    kind: Role
    token_id: str
    csrf: str  # every form and htmx request sends it back; a cross-site page cannot read it
    expires: int  # unix seconds
    name: str = ""  # the token's name (LORAPLANE_ADMIN_TOKENS' name=token), as audit rows name the caller

    @property
    def principal(self) -> Principal:
        return Principal(kind=self.kind, token_id=self.token_id, name=self.name)

    @property
    def can_act(self) -> bool:
        return self.kind == "admin"


class SessionCodec:
    """Signs and checks session cookies; one per app."""

    def __init__(self, settings: ControlPlaneSettings) -> None:
        self._settings = settings
        secret = settings.ui_session_secret
        if secret is None:
            logger.warning("LORAPLANE_UI_SESSION_SECRET is unset: the web console signs sessions with a random "
                           "per-process secret, so sessions do not survive a restart nor span replicas")
            secret = secrets.token_hex(32)
        self._key = hashlib.sha256(b"loraplane-console-session:" + secret.encode()).digest()
        self._roles = {token_id(t): "admin" for t in settings.admin_tokens}
        self._roles.update({token_id(t): "read" for t in settings.read_tokens})

    def role_of(self, offered: str) -> Role | None:
        """The role of a token offered at sign-in (compared in constant time, every token each time)."""
        found: Role | None = None
        by_role: tuple[tuple[Role, tuple[str, ...]], ...] = (
            ("admin", self._settings.admin_tokens), ("read", self._settings.read_tokens))
        for role, tokens in by_role:
            for token in tokens:
                if hmac.compare_digest(offered.encode(), token.encode()) and found is None:
                    found = role
        return found

    def issue(self, kind: Role, offered: str) -> tuple[ConsoleSession, str]:
        offered_id = token_id(offered)
        session = ConsoleSession(kind=kind, token_id=offered_id, csrf=secrets.token_urlsafe(24),
                                 expires=int(time.time()) + MAX_AGE_S,
                                 name=self._settings.token_names.get(offered_id, ""))
        payload = base64.urlsafe_b64encode(json.dumps(session.__dict__, separators=(",", ":")).encode()).decode()
        return session, f"{payload}.{self._sign(payload)}"

    def read(self, cookie: str | None) -> ConsoleSession | None:
        """The session a cookie holds, or None (missing, forged, expired, or its token no longer configured)."""
        payload, _, signature = (cookie or "").partition(".")
        if not payload or not hmac.compare_digest(signature.encode(), self._sign(payload).encode()):
            return None
        try:
            session = ConsoleSession(**json.loads(base64.urlsafe_b64decode(payload)))
        except (ValueError, TypeError):
            return None
        if session.expires < time.time() or self._roles.get(session.token_id) != session.kind:
            return None
        return session

    def _sign(self, payload: str) -> str:
        return hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()
