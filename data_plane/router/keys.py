"""Who a client is: `Caller` from its `Authorization: Bearer` key, checked once and then cached.

Without --require-api-key the router's static keys (LORAPLANE_API_KEYS) are all there is (none: open).
With it, a key is either a static key (an operator's: every model, no quota) or a tenant key
`lp_<key id>_<secret>`: its record comes from the control plane by key id (GET /v1/tenancy/keys/{id})
and the secret is verified against the record's hash (shared/key_secrets.py: an HMAC under
LORAPLANE_KEY_PEPPER, cheap; a legacy argon2 hash off the event loop, after which the control
plane is asked to rewrite it as HMAC: POST /v1/tenancy/keys/{id}/rehash). The record and the verified
secret are kept for `ttl_s`; within it, the key's holder costs a sha256 and a constant-time compare,
and any other secret offered for that id is refused without a hash (a key id has one secret). After
the TTL the record is fetched again (the secret verified again only if the hash changed), so a revoked
key stops within `ttl_s` even when the control plane's Redis message is lost; with the message
(`RevocationListener`), at once. A control plane that cannot be reached keeps verified keys working
(retried every second); unknown ones are 503 until it answers.

Failed attempts (an unknown key id, a wrong secret) are limited per client address and per key id
(shared/key_checks.py): past the limits, 429 before any control-plane call or hash, except for the
secret already verified. A key id the control plane does not know and a revoked key are remembered
(`Misses`, at most MAX_MISSES for `miss_ttl_s`, 1 s): within it the same key id is refused without a
control-plane call, so a key created after a client tried its id works at most `miss_ttl_s` after it
exists. A malformed key never reaches the control plane (split_key refuses it first).
"""

from __future__ import annotations

import asyncio
import hmac
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
from shared.key_checks import InvalidKeyError, KeyChecks
from shared.key_secrets import KeyHasher
from shared.tenants import (
    INFERENCE,
    KEY_PREFIX,
    KEYS_PATH,
    REHASH_SUFFIX,
    KeyRecord,
    Limits,
    RehashRequest,
    revocation_channel,
    split_key,
)

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
class _Entry:
    record: KeyRecord
    caller: Caller
    checked_at: float  # time.monotonic() of the record's fetch
    verified: bytes | None = None  # digest of the secret verified against record.secret_hash


def _entry(record: KeyRecord, verified: bytes | None, checked_at: float) -> _Entry:
    caller = Caller(tenant=record.tenant, key_id=record.key_id, limits=record.limits,
                    tenant_limits=record.tenant_limits)
    return _Entry(record, caller, checked_at, verified)


class Misses:
    """Refusals kept for `ttl_s`, at most `size` (the oldest go first): the error a key id got."""

    def __init__(self, size: int, ttl_s: float) -> None:
        self.size = size
        self.ttl_s = ttl_s
        self._until: dict[str, tuple[float, str, bool]] = {}  # insertion order = age

    def get(self, key_id: str) -> AuthenticationError | None:
        found = self._until.get(key_id)
        if found is None:
            return None
        if found[0] <= time.monotonic():
            del self._until[key_id]
            return None
        return self._error(found[1], found[2])  # a new one: a raised error keeps its frames

    def put(self, key_id: str, message: str, *, unknown: bool) -> AuthenticationError:
        self._until.pop(key_id, None)
        while len(self._until) >= self.size:
            del self._until[next(iter(self._until))]
        self._until[key_id] = (time.monotonic() + self.ttl_s, message, unknown)
        return self._error(message, unknown)

    @staticmethod
    def _error(message: str, unknown: bool) -> AuthenticationError:
        """An unknown key id is a failed attempt (InvalidKeyError); a revoked key is not a guess."""
        return InvalidKeyError(message) if unknown else AuthenticationError(message, code="invalid_api_key")

    def __len__(self) -> int:
        return len(self._until)


class KeyVerifier:
    def __init__(self, control_plane: httpx.AsyncClient, static_keys: frozenset[str], *, required: bool,
                 ttl_s: float, hasher: KeyHasher, checks: KeyChecks, miss_ttl_s: float = MISS_TTL_S) -> None:
        self.control_plane = control_plane
        self.static_keys = static_keys
        self.required = required
        self.ttl_s = ttl_s
        self.hasher = hasher
        self.checks = checks
        self.misses = Misses(MAX_MISSES, miss_ttl_s)
        self._cache: dict[str, _Entry] = {}
        self._pending: dict[str, asyncio.Future[KeyRecord | None]] = {}  # one fetch per key id at a time
        self._rehashing: dict[str, asyncio.Task[None]] = {}  # one upgrade of a legacy hash per key id

    async def caller(self, authorization: str | None, client: str = "") -> Caller:
        """The request's caller (`client`: its address); AuthenticationError (401), PermissionDeniedError
        (403) or RateLimitError (429) otherwise."""
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
        digest = key_secrets.digest(secret)
        entry = self._cache.get(key_id)
        holder = entry is not None and entry.verified is not None and hmac.compare_digest(entry.verified, digest)
        if entry is None or not holder or time.monotonic() - entry.checked_at >= self.ttl_s:
            with self.checks.attempt(key_id, client, holder=holder):
                entry = await self._check(key_id, secret, digest, entry, holder, client)
        if INFERENCE not in entry.record.scopes:
            raise PermissionDeniedError("This API key has no `inference` scope.", code="insufficient_scope")
        if entry.record.expires_at is not None and entry.record.expires_at <= time.time():
            raise AuthenticationError("This API key has expired.", code="invalid_api_key")
        return entry.caller

    async def _check(self, key_id: str, secret: str, digest: bytes, entry: _Entry | None, holder: bool,
                     client: str) -> _Entry:
        """The entry whose verified secret is `secret`; InvalidKeyError for an unknown id or another secret."""
        if entry is not None and entry.verified is not None and not holder:
            raise InvalidKeyError(_INVALID)  # the key's one secret is known here: no fetch, no hash
        if entry is None or time.monotonic() - entry.checked_at >= self.ttl_s:
            entry = await self._refresh(key_id, entry)
        if entry.verified is not None:
            if not hmac.compare_digest(entry.verified, digest):
                raise InvalidKeyError(_INVALID)
            return entry
        stored = entry.record.secret_hash
        if not await self.checks.check(self.hasher, key_id, secret, stored, client):
            raise InvalidKeyError(_INVALID)
        if key_secrets.is_legacy(stored):
            self._upgrade(key_id, secret)
        if self._cache.get(key_id) is entry:
            entry.verified = digest
        return entry

    async def _refresh(self, key_id: str, entry: _Entry | None) -> _Entry:
        miss = self.misses.get(key_id)
        if miss is not None:
            raise miss
        try:
            record = await self._fetch(key_id)
        except OverloadedError:
            if entry is None or entry.verified is None:
                raise
            entry.checked_at = time.monotonic() - self.ttl_s + _RETRY_S  # keep it; ask again soon
            return entry
        if record is None or record.revoked:
            self._cache.pop(key_id, None)
            raise self.misses.put(key_id, _INVALID if record is None else "This API key has been revoked.",
                                  unknown=record is None)
        same = entry is not None and entry.record.secret_hash == record.secret_hash
        if len(self._cache) >= _MAX_CACHED:
            self._cache.clear()
        fresh = self._cache[key_id] = _entry(record, entry.verified if same and entry else None, time.monotonic())
        return fresh

    def _upgrade(self, key_id: str, secret: str) -> None:
        """Ask the control plane, in a task of its own, to rewrite the key's legacy hash as HMAC (it checks
        the key against the stored hash itself). Not without a pepper: this router could not verify the
        new hash."""
        if not self.hasher.ready or key_id in self._rehashing:
            return
        task = asyncio.create_task(self._rehash(key_id, f"{KEY_PREFIX}{key_id}_{secret}"))
        self._rehashing[key_id] = task
        task.add_done_callback(lambda _: self._rehashing.pop(key_id, None))

    async def _rehash(self, key_id: str, key: str) -> None:
        try:
            response = await self.control_plane.post(f"{KEYS_PATH}/{quote(key_id, safe='')}{REHASH_SUFFIX}",
                                                     content=msgspec.json.encode(RehashRequest(key=key)),
                                                     headers={"Content-Type": "application/json"})
        except httpx.HTTPError as exc:
            logger.warning("cannot have key %s's hash upgraded by the control plane: %s", key_id, type(exc).__name__)
            return
        if response.status_code != 200:
            logger.warning("the control plane answered %d to key %s's hash upgrade", response.status_code, key_id)
            return
        record = _record.decode(response.content)
        entry = self._cache.get(key_id)
        # the same secret: it verified against the new hash as well
        if entry is not None and entry.verified is not None and not record.revoked:
            self._cache[key_id] = _entry(record, entry.verified, entry.checked_at)

    async def aclose(self) -> None:
        """Wait for the hash upgrades under way."""
        await asyncio.gather(*self._rehashing.values(), return_exceptions=True)

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
