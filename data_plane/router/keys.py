"""Who a client is: `Caller` from its `Authorization: Bearer` key, checked once and then cached.

Without --require-api-key the router's static keys (LORAPLANE_API_KEYS) are all there is (none: open).
With it, a key is either a static key (an operator's: every model, no quota) or a tenant key
`lp_<key id>_<secret>`: its record comes from the control plane by key id (GET /v1/tenancy/keys/{id}),
the secret is verified against its argon2 hash once (off the event loop), and the verified key is kept
for `ttl_s`; within it, each request costs a sha256 and a constant-time compare. After the TTL the
record is fetched again (argon2 runs again only if the hash changed), so a revoked key stops within
`ttl_s` even when the control plane's Redis message is lost; with the message (`RevocationListener`),
at once. A control plane that cannot be reached keeps verified keys working (retried every second);
unknown ones are 503 until it answers.

Refusals are remembered too (`Misses`, at most MAX_MISSES for `miss_ttl_s`, 1 s): a key id the control
plane does not know and a revoked key by key id, a wrong secret by the digest of the whole key; within
the TTL the same offer is refused without a control-plane call or an argon2 hash. A key whose id was
refused (created after a client tried it) works at most `miss_ttl_s` after it exists. A malformed key
never reaches the control plane (split_key refuses it first).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from urllib.parse import quote

import httpx
import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from data_plane.router.request import check_client_key
from shared import key_secrets
from shared.errors import AuthenticationError, OverloadedError, PermissionDeniedError
from shared.tenants import INFERENCE, KEY_PREFIX, KEYS_PATH, KeyRecord, Limits, revocation_channel, split_key

logger = logging.getLogger(__name__)
_MAX_CACHED = 100_000
MAX_MISSES = 10_000
MISS_TTL_S = 1.0
_RETRY_S = 1.0  # a control plane that did not answer is asked again after this long
_record = msgspec.json.Decoder(KeyRecord)
_INVALID = ("Incorrect API key provided: send `Authorization: Bearer <key>` with a key of this fleet "
            "(a tenant key, or one of the router's LORAPLANE_API_KEYS).")


@dataclass(frozen=True)
class Caller:
    """An operator (static key or open router: `tenant` None, everything allowed, no quota) or a tenant key."""

    tenant: str | None = None
    key_id: str = ""
    limits: Limits = field(default_factory=Limits)
    tenant_limits: Limits = field(default_factory=Limits)


OPERATOR = Caller()


@dataclass
class _Verified:
    digest: bytes
    secret_hash: str
    caller: Caller
    expires_at: float | None
    checked_at: float  # time.monotonic() of the last record fetched


class Misses:
    """Refusals kept for `ttl_s`, at most `size` (the oldest go first): what a miss answered, by key."""

    def __init__(self, size: int, ttl_s: float) -> None:
        self.size = size
        self.ttl_s = ttl_s
        self._until: dict[bytes, tuple[float, str]] = {}  # insertion order = age

    def get(self, key: bytes) -> AuthenticationError | None:
        found = self._until.get(key)
        if found is None:
            return None
        if found[0] <= time.monotonic():
            del self._until[key]
            return None
        return AuthenticationError(found[1], code="invalid_api_key")  # a new one: a raised error keeps its frames

    def put(self, key: bytes, message: str) -> AuthenticationError:
        self._until.pop(key, None)
        while len(self._until) >= self.size:
            del self._until[next(iter(self._until))]
        self._until[key] = (time.monotonic() + self.ttl_s, message)
        return AuthenticationError(message, code="invalid_api_key")

    def __len__(self) -> int:
        return len(self._until)


class KeyVerifier:
    def __init__(self, control_plane: httpx.AsyncClient, static_keys: frozenset[str], *, required: bool,
                 ttl_s: float, miss_ttl_s: float = MISS_TTL_S) -> None:
        self.control_plane = control_plane
        self.static_keys = static_keys
        self.required = required
        self.ttl_s = ttl_s
        self.misses = Misses(MAX_MISSES, miss_ttl_s)
        self._cache: dict[str, _Verified] = {}
        self._pending: dict[str, asyncio.Future[KeyRecord | None]] = {}  # one fetch per key id at a time

    async def caller(self, authorization: str | None) -> Caller:
        """The request's caller; AuthenticationError (401) or PermissionDeniedError (403) otherwise."""
        if not self.required:
            check_client_key(authorization, self.static_keys)
            return OPERATOR
        scheme, _, offered = (authorization or "").strip().partition(" ")
        offered = offered.strip()
        parts = split_key(offered) if scheme.lower() == "bearer" else None
        if parts is None:
            if not self.static_keys:
                raise AuthenticationError(_INVALID, code="invalid_api_key")
            check_client_key(authorization, self.static_keys)
            return OPERATOR
        key_id, secret = parts
        entry = self._cache.get(key_id)
        if entry is None or time.monotonic() - entry.checked_at >= self.ttl_s:
            miss = self.misses.get(key_id.encode()) or self.misses.get(key_secrets.digest(offered))
            if miss is not None:
                raise miss
            entry = await self._refresh(key_id, secret, entry)
        if not key_secrets.same_secret(entry.digest, secret):
            raise AuthenticationError(_INVALID, code="invalid_api_key")
        if entry.expires_at is not None and entry.expires_at <= time.time():
            raise AuthenticationError("This API key has expired.", code="invalid_api_key")
        return entry.caller

    async def _refresh(self, key_id: str, secret: str, entry: _Verified | None) -> _Verified:
        try:
            record = await self._fetch(key_id)
        except OverloadedError:
            if entry is None:
                raise
            entry.checked_at = time.monotonic() - self.ttl_s + _RETRY_S  # keep it; ask again soon
            return entry
        if record is None or record.revoked:
            self._cache.pop(key_id, None)
            raise self.misses.put(key_id.encode(), _INVALID if record is None else "This API key has been revoked.")
        if INFERENCE not in record.scopes:
            raise PermissionDeniedError("This API key has no `inference` scope.", code="insufficient_scope")
        same = entry is not None and entry.secret_hash == record.secret_hash and key_secrets.same_secret(
            entry.digest, secret)
        if not same and not await asyncio.to_thread(key_secrets.verify, record.secret_hash, secret):
            raise self.misses.put(key_secrets.digest(f"{KEY_PREFIX}{key_id}_{secret}"), _INVALID)
        caller = Caller(tenant=record.tenant, key_id=key_id, limits=record.limits, tenant_limits=record.tenant_limits)
        if len(self._cache) >= _MAX_CACHED:
            self._cache.clear()
        verified = _Verified(key_secrets.digest(secret), record.secret_hash, caller, record.expires_at,
                             time.monotonic())
        self._cache[key_id] = verified
        return verified

    async def _fetch(self, key_id: str) -> KeyRecord | None:
        """The key's record (None: no such key); concurrent requests of one key share one fetch."""
        pending = self._pending.get(key_id)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[KeyRecord | None] = asyncio.get_running_loop().create_future()
        self._pending[key_id] = future
        try:
            result = await self._get(key_id)
            future.set_result(result)
            return result
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: no "never retrieved" warning when nobody else waited
            raise
        finally:
            del self._pending[key_id]

    async def _get(self, key_id: str) -> KeyRecord | None:
        try:
            response = await self.control_plane.get(f"{KEYS_PATH}/{quote(key_id, safe='')}")
        except httpx.HTTPError as exc:
            logger.warning("cannot check key %s with the control plane: %s", key_id, type(exc).__name__)
            raise OverloadedError("The router cannot check API keys now (control plane unreachable); retry.") from None
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            logger.warning("the control plane answered %d to a key check", response.status_code)
            raise OverloadedError("The router cannot check API keys now; retry.")
        return _record.decode(response.content)

    def forget(self, event: str) -> None:
        """`key:<id>` (revoked: gone at once) or `tenant:<name>` (its limits changed: fetched again)."""
        kind, _, name = event.partition(":")
        if kind == "key":
            self._cache.pop(name, None)
        elif kind == "tenant":
            for key_id in [k for k, v in self._cache.items() if v.caller.tenant == name]:
                self._cache[key_id].checked_at = float("-inf")


class RevocationListener:
    """Subscribes to the control plane's revocation channel and tells the verifier; reconnects forever."""

    def __init__(self, redis_url: str | None, prefix: str, verifier: KeyVerifier) -> None:
        self.redis_url = redis_url
        self.channel = revocation_channel(prefix)
        self.verifier = verifier
        self.subscribed = asyncio.Event()  # for tests and /health: set while subscribed

    async def run(self) -> None:
        if not self.redis_url:
            return
        failing = False
        while True:
            client = aioredis.from_url(self.redis_url, socket_connect_timeout=1.0)
            try:
                async with client.pubsub() as pubsub:
                    await pubsub.subscribe(self.channel)
                    self.subscribed.set()
                    if failing:
                        logger.info("subscribed to key revocations again")
                        failing = False
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            self.verifier.forget(message["data"].decode())
            except (RedisError, OSError) as exc:
                self.subscribed.clear()
                if not failing:
                    logger.warning("key revocations: Redis unreachable (%s); keys are checked again within the "
                                   "cache TTL", type(exc).__name__)
                    failing = True
            finally:
                await client.aclose()
            await asyncio.sleep(1.0)
