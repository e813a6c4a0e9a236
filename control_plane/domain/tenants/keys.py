"""Tenant keys at the control plane: who an `lp_…` bearer is, and what such a key may touch.

`TenantAuth.principal` finds the key by its id, verifies the secret against its hash once
(shared/key_secrets.py: HMAC under the pepper; a legacy argon2 hash off the event loop, then rewritten as
HMAC, compare-and-set on the old hash) and keeps the verified key for CACHE_TTL_S, comparing later offers
with a constant-time digest compare (another secret for a cached key id is refused without a lookup or
hash); a revoked or expired key stops within that TTL on every replica (at once on this one). Failed
attempts are limited per client address and per key id (shared/key_checks.py: 429 past the limits). The
principal is kind "tenant", named in the audit trail as `key:<key id>`. `TenantAuth.rehash` is the same
check and rewrite for a key a router verified against a legacy hash (POST /v1/tenancy/keys/{id}/rehash).

`TenantAuth.gate` is what the guards (control_plane.auth) ask on routes marked `opt={"tenant_role": …}`:
a key with `admin:<tenant>` may manage its own tenant ("tenant": the `{tenant}` path parameter) and its
tenant's adapters ("adapter": the adapter named in the path or the body's `lora_name`); another tenant's
adapter, or one nobody owns, is a 404, as if it did not exist (public ones may be read). Everything
else is refused by the guards (403).
"""

from __future__ import annotations

import hmac
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar.connection import ASGIConnection, Request
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.auth import Principal
from control_plane.db.models import Adapter, ApiKey, Tenant
from control_plane.db.session import WriteGate
from control_plane.db.transaction import transact
from shared import key_secrets
from shared.errors import AuthenticationError, NotFoundError
from shared.key_checks import InvalidKeyError, KeyChecks
from shared.key_secrets import KeyHasher, NoPepperError

logger = logging.getLogger(__name__)
CACHE_TTL_S = 5.0
_MAX_CACHED = 10_000
_SUFFIX = re.compile(r"/(activate|versions(/\d+)?)$")
_READING = frozenset({"GET", "HEAD"})
_INVALID = "The API key is not valid (unknown, revoked or expired)."


class _LoadBody(msgspec.Struct):
    lora_name: str = ""


@dataclass(frozen=True)
class _Verified:
    digest: bytes
    principal: Principal
    expires_at: float | None  # epoch seconds
    checked_at: float  # time.monotonic()


class TenantAuth:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], gate: WriteGate, hasher: KeyHasher,
                 checks: KeyChecks) -> None:
        self.sessions = sessions
        self.write_gate = gate
        self.hasher = hasher
        self.checks = checks
        self._cache: dict[str, _Verified] = {}

    async def principal(self, key_id: str, secret: str, client: str) -> Principal:
        digest = key_secrets.digest(secret)
        cached = self._cache.get(key_id)
        now = time.monotonic()
        holder = cached is not None and hmac.compare_digest(cached.digest, digest)
        if cached is not None and holder and now - cached.checked_at < CACHE_TTL_S:
            if cached.expires_at is not None and cached.expires_at <= time.time():
                raise AuthenticationError(_INVALID, code="invalid_api_key")
            return cached.principal
        with self.checks.attempt(key_id, client, holder=holder):
            if cached is not None and not holder:
                raise InvalidKeyError(_INVALID)  # the key's one secret is known here: no lookup, no hash
            found = await self._find(key_id)
            if found is None:
                raise InvalidKeyError(_INVALID)
            key, tenant = found
            expires_at = key.expires_at.timestamp() if key.expires_at else None
            if key.revoked_at is not None or (expires_at is not None and expires_at <= time.time()):
                self._cache.pop(key_id, None)
                raise AuthenticationError(_INVALID, code="invalid_api_key")
            if not await self._verify(key, secret, client):
                raise InvalidKeyError(_INVALID)
        principal = Principal(kind="tenant", token_id=f"key:{key_id}", tenant=tenant, scopes=frozenset(key.scopes),
                              name=f"{tenant}/{key.name}")
        if len(self._cache) >= _MAX_CACHED:
            self._cache.clear()
        self._cache[key_id] = _Verified(digest, principal, expires_at, now)
        return principal

    async def rehash(self, key_id: str, secret: str, client: str) -> None:
        """Check `secret` against the key's stored hash (rewriting a legacy one as HMAC), counted like a
        tenant key's attempt: NotFoundError, InvalidKeyError (another secret), NoPepperError, RateLimitError."""
        if not self.hasher.ready:
            raise NoPepperError
        with self.checks.attempt(key_id, client):
            found = await self._find(key_id)
            if found is None:
                raise NotFoundError(f"no key {key_id!r}", param="key_id")
            if not await self._verify(found[0], secret, client):
                raise InvalidKeyError(f"`key` is not key {key_id!r}'s.")

    async def _find(self, key_id: str) -> tuple[ApiKey, str] | None:
        async with self.sessions() as session:
            found = (await session.execute(select(ApiKey, Tenant.name).join(Tenant, Tenant.id == ApiKey.tenant_id)
                                           .where(ApiKey.key_id == key_id))).first()
        return None if found is None else (found[0], found[1])

    async def _verify(self, key: ApiKey, secret: str, client: str) -> bool:
        """Whether `secret` is the key's; a legacy hash that it matches is rewritten as HMAC (compare-and-set
        on the old hash: a concurrent rewrite wins, with the same result), when there is a pepper."""
        stored = key.secret_hash
        if not await self.checks.check(self.hasher, key.key_id, secret, stored, client):
            return False
        if key_secrets.is_legacy(stored) and self.hasher.ready:
            new = self.hasher.hash(key.key_id, secret)

            async def work(session: AsyncSession) -> None:
                await session.execute(update(ApiKey).where(ApiKey.key_id == key.key_id, ApiKey.secret_hash == stored)
                                      .values(secret_hash=new))

            try:
                async with self.sessions() as session:
                    await transact(session, self.write_gate, work, what=f"rehash key {key.key_id!r}", idempotent=True)
            except Exception as exc:  # the key is verified all the same; its next success tries again
                logger.warning("cannot rewrite key %s's legacy hash: %s", key.key_id, type(exc).__name__)
        return True

    def forget(self, event: str) -> None:
        """A revocation (`key:<id>`) or a tenant's change (`tenant:<name>`) made on this replica takes
        effect here at once (on other replicas within CACHE_TTL_S)."""
        kind, _, name = event.partition(":")
        if kind == "key":
            self._cache.pop(name, None)
        else:
            self._cache = {k: v for k, v in self._cache.items() if v.principal.tenant != name}

    async def gate(self, connection: ASGIConnection[Any, Any, Any, Any], role: str, principal: Principal) -> None:
        """Raise unless the tenant key may go on (see the module doc); 404 for adapters it may not see."""
        if role == "tenant":
            if connection.path_params.get("tenant") != principal.tenant:
                raise NotFoundError(f"no tenant named {connection.path_params.get('tenant')!r}", param="tenant")
            return
        name = await _adapter_named(connection)
        if not name:
            return  # the handler answers what a body without a name deserves
        async with self.sessions() as session:
            row = (await session.execute(select(Tenant.name, Adapter.public).select_from(Adapter)
                                         .outerjoin(Tenant, Tenant.id == Adapter.owner_tenant_id)
                                         .where(Adapter.name == name))).first()
        if row is None:
            return  # a new adapter (a load makes the tenant its owner) or the handler's own 404
        owner, public = row
        reading = isinstance(connection, Request) and connection.method in _READING  # (guards see HTTP calls)
        if owner == principal.tenant or (public and reading):
            return
        raise NotFoundError(f"no adapter named {name!r} is registered", param="name")


async def _adapter_named(connection: ASGIConnection[Any, Any, Any, Any]) -> str:
    """The adapter a call is about: the `{name}` path parameter without its route suffix, or the body's
    `lora_name` (load, unload: small JSON bodies, read once and kept for the handler)."""
    path_name = connection.path_params.get("name")
    if path_name is not None:
        return _SUFFIX.sub("", str(path_name).lstrip("/"))
    if not isinstance(connection, Request):
        return ""  # no body to read (guards see HTTP calls, Requests, only)
    try:
        return msgspec.json.decode(await connection.body(), type=_LoadBody).lora_name
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ""
