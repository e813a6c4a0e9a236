"""Tenant keys at the control plane: who an `lp_…` bearer is, and what such a key may touch.

`TenantAuth.principal` finds the key by its id, verifies the secret with argon2 once (off the event loop)
and keeps the verified key for CACHE_TTL_S, comparing later offers with a constant-time digest compare;
a revoked or expired key stops within that TTL on every replica (at once on this one). The principal is
kind "tenant", named in the audit trail as `key:<key id>`.

`TenantAuth.gate` is what the guards (control_plane.auth) ask on routes marked `opt={"tenant_role": …}`:
a key with `admin:<tenant>` may manage its own tenant ("tenant": the `{tenant}` path parameter) and its
tenant's adapters ("adapter": the adapter named in the path or the body's `lora_name`); another tenant's
adapter, or one nobody owns, is a 404, as if it did not exist (public ones may be read). Everything
else is refused by the guards (403).
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass

import msgspec
from litestar.connection import ASGIConnection
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.auth import Principal
from control_plane.db.models import Adapter, ApiKey, Tenant
from shared import key_secrets
from shared.errors import AuthenticationError, NotFoundError

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
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.sessions = sessions
        self._cache: dict[str, _Verified] = {}

    async def principal(self, key_id: str, secret: str) -> Principal:
        cached = self._cache.get(key_id)
        now = time.monotonic()
        if cached is not None and now - cached.checked_at < CACHE_TTL_S:
            if not key_secrets.same_secret(cached.digest, secret):
                raise AuthenticationError(_INVALID, code="invalid_api_key")
            if cached.expires_at is not None and cached.expires_at <= time.time():
                raise AuthenticationError(_INVALID, code="invalid_api_key")
            return cached.principal
        async with self.sessions() as session:
            found = (await session.execute(select(ApiKey, Tenant.name).join(Tenant, Tenant.id == ApiKey.tenant_id)
                                           .where(ApiKey.key_id == key_id))).first()
        if found is None:
            raise AuthenticationError(_INVALID, code="invalid_api_key")
        key, tenant = found
        expires_at = key.expires_at.timestamp() if key.expires_at else None
        usable = key.revoked_at is None and (expires_at is None or expires_at > time.time())
        if not usable or not await asyncio.to_thread(key_secrets.verify, key.secret_hash, secret):
            self._cache.pop(key_id, None)
            raise AuthenticationError(_INVALID, code="invalid_api_key")
        principal = Principal(kind="tenant", token_id=f"key:{key_id}", tenant=tenant, scopes=frozenset(key.scopes))
        if len(self._cache) >= _MAX_CACHED:
            self._cache.clear()
        self._cache[key_id] = _Verified(key_secrets.digest(secret), principal, expires_at, now)
        return principal

    def forget(self, event: str) -> None:
        """A revocation (`key:<id>`) or a tenant's change (`tenant:<name>`) made on this replica takes
        effect here at once (on other replicas within CACHE_TTL_S)."""
        kind, _, name = event.partition(":")
        if kind == "key":
            self._cache.pop(name, None)
        else:
            self._cache = {k: v for k, v in self._cache.items() if v.principal.tenant != name}

    async def gate(self, connection: ASGIConnection, role: str, principal: Principal) -> None:
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
        if owner == principal.tenant or (public and connection.method in _READING):
            return
        raise NotFoundError(f"no adapter named {name!r} is registered", param="name")


async def _adapter_named(connection: ASGIConnection) -> str:
    """The adapter a call is about: the `{name}` path parameter without its route suffix, or the body's
    `lora_name` (load, unload: small JSON bodies, read once and kept for the handler)."""
    path_name = connection.path_params.get("name")
    if path_name is not None:
        return _SUFFIX.sub("", str(path_name).lstrip("/"))
    try:
        return msgspec.json.decode(await connection.body(), type=_LoadBody).lora_name  # type: ignore[attr-defined]
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ""
