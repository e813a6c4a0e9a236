"""The console's session cookie: who signed in (role and token id, never the token), its session id, its
CSRF token and when it ends, signed with HMAC-SHA256 under the settings' `ui_session_secret`.

The token itself is not kept: each request checks that the token id still belongs to a configured admin
or read token, so a token removed from the settings ends its sessions at the next restart. Signing out
records the session id (console_session_ends) until the cookie would have expired, and `current` refuses
a recorded one, so a copy of the cookie is worth nothing afterwards, on every replica.

The cookie is `Secure` when the request came over https: its own scheme, or `X-Forwarded-Proto` from a
proxy that uvicorn trusts (FORWARDED_ALLOW_IPS, default 127.0.0.1); from anyone else the header is ignored.
Failed sign-ins count against the client's address (`SignInLimits`: LORAPLANE_KEY_FAILURES_PER_ADDRESS per
LORAPLANE_KEY_FAILURE_WINDOW_S, as tenant keys) and are audited.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal

from litestar import Request
from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.auth import Principal, token_id
from control_plane.db.models import ConsoleSessionEnd
from control_plane.db.transaction import transact
from control_plane.settings import ControlPlaneSettings
from shared.key_checks import address_of

logger = logging.getLogger(__name__)

COOKIE = "loraplane_console"
MAX_AGE_S = 8 * 3600
Role = Literal["admin", "read"]


@dataclass(frozen=True)
class ConsoleSession:
    kind: Role
    token_id: str
    sid: str  # recorded when the session is signed out of
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
        session = ConsoleSession(kind=kind, token_id=offered_id, sid=secrets.token_urlsafe(18),
                                 csrf=secrets.token_urlsafe(24), expires=int(time.time()) + MAX_AGE_S,
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

    async def current(self, request: Request[Any, Any, Any]) -> ConsoleSession | None:
        """The request's session, or None: `read`, and not signed out of."""
        session = self.read(request.cookies.get(COOKIE))
        if session is None:
            return None
        async with request.app.state.audit_sessions() as db:
            ended = await db.scalar(select(ConsoleSessionEnd.id).where(ConsoleSessionEnd.sid == session.sid))
        return None if ended is not None else session

    async def end(self, request: Request[Any, Any, Any], session: ConsoleSession) -> None:
        """Sign `session` out on the server (expired ends are dropped meanwhile)."""
        now = dt.datetime.now(dt.UTC)

        async def record(db: AsyncSession) -> None:
            await db.execute(delete(ConsoleSessionEnd).where(ConsoleSessionEnd.expires_at < now))
            if await db.scalar(select(ConsoleSessionEnd.id).where(ConsoleSessionEnd.sid == session.sid)) is None:
                db.add(ConsoleSessionEnd(sid=session.sid, expires_at=dt.datetime.fromtimestamp(session.expires, dt.UTC)))

        state = request.app.state
        async with state.audit_sessions() as db:
            await transact(db, state.write_gate, record, what="ending a console session", idempotent=True, races=True)

    def _sign(self, payload: str) -> str:
        return hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()


def over_https(request: Request[Any, Any, Any]) -> bool:
    """Whether the request came over https (uvicorn has applied X-Forwarded-Proto from trusted proxies only)."""
    return request.url.scheme == "https"


class SignInLimits:
    """Failed sign-ins per client address (an IPv6 address by its /64), in fixed windows: past `limit`, the
    address's sign-ins are refused until its window ends, before any token is compared."""

    def __init__(self, limit: int, window_s: float, max_tracked: int = 100_000) -> None:
        self.limit, self.window_s, self.max_tracked = limit, window_s, max_tracked
        self._windows: dict[str, tuple[float, int]] = {}  # address -> (window start, failures)

    def wait_s(self, host: str) -> float | None:
        """Seconds until `host` may try again; None while it is under the limit."""
        start, failures = self._windows.get(address_of(host), (0.0, 0))
        now = time.monotonic()
        if failures < self.limit or now - start >= self.window_s:
            return None
        return start + self.window_s - now

    def fail(self, host: str) -> int:
        """Count a failure of `host`; the failures of its current window."""
        address, now = address_of(host), time.monotonic()
        start, failures = self._windows.pop(address, (now, 0))
        if now - start >= self.window_s:
            start, failures = now, 0
        while len(self._windows) >= self.max_tracked:
            del self._windows[next(iter(self._windows))]
        self._windows[address] = (start, failures + 1)
        return failures + 1
