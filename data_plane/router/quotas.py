"""Tenant quotas, counted in Redis so that every router replica shares them: one script call to admit a
request, one to settle it.

Requests and tokens per minute are token buckets (capacity = the limit, refilled at limit/60 per second,
so a minute's quota may be spent at once and then returns evenly); concurrent requests are leases in a
sorted set (score: when the lease lapses, so a router that died holding some frees them after
`lease_s`). A tenant's buckets are shared by all its keys; a key's own limits apply on top.

    admit:  a token reservation larger than a tokens-per-minute limit can never fit: 429 at once, Redis
            untouched. Otherwise every bucket refilled to now; refused (429) unless each holds its cost
            (1 request; the token reservation) and each set has room; otherwise every bucket pays and
            every set gets the lease, all in one Lua script (atomic: two routers can never both spend
            the last unit)
    charge: while a stream runs, its token buckets pay the difference between what the engine's
            usage says so far (exact prompt tokens, completion tokens as generated) and what the
            request has paid (tenancy.py batches these: one call per ~100 ms or 128 tokens at most);
            a bucket may go below zero, and other requests on every replica wait for it
    settle: the token buckets pay the difference to what the engine says was used in the end (the
            reservation comes back when less was used); the leases go
    refund: a request no engine accepted (each refused it, or none could be reached) gives back all it
            paid: 1 to each request bucket, its tokens to each token bucket; the leases go

A bucket untouched for two minutes goes (it is full again by then), unless it is in debt: it lives until
it has refilled to full, so a debt is never forgotten before it is paid back. Each bucket also counts
`charged`: every unit it was charged since it was created (it goes with the bucket), what operators (and
tests) read to see what a tenant was billed.

Time is Redis's (TIME), so replicas' clocks do not matter. Redis unreachable: `failure` "closed"
answers 503, "open" admits uncounted; after a failure Redis is left alone for RETRY_S, and a ping every
PING_S keeps `health()` current either way.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.errors import LoraplaneError, OverloadedError
from shared.tenants import Limits

logger = logging.getLogger(__name__)
RETRY_S = 1.0
PING_S = 2.0
_BUCKET_TTL_MS = 120_000  # a bucket untouched this long is full again anyway (a bucket in debt lives longer)

# both scripts: Redis's clock in ms, a bucket's level refilled to now, and writing it back (kept at least
# until it has refilled to full: a bucket that goes comes back full)
_BUCKETS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function level_of(key, limit)
  local state = redis.call('HMGET', key, 'level', 'at')
  local level = tonumber(state[1]) or limit
  local at = tonumber(state[2]) or now
  return math.min(limit, level + (now - at) * limit / 60000)
end
local function store(key, limit, level, charged)
  redis.call('HSET', key, 'level', tostring(level), 'at', now)
  redis.call('HINCRBY', key, 'charged', charged)
  redis.call('PEXPIRE', key, math.max(BUCKET_TTL_MS, math.ceil((limit - level) * 60000 / limit)))
end
""".replace("BUCKET_TTL_MS", str(_BUCKET_TTL_MS))

_ADMIT = _BUCKETS + """
local n, m, lease, lease_ms = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local levels, refused, wait = {}, 0, 0
for i = 1, n do
  local limit, cost = tonumber(ARGV[3 + 2 * i]), tonumber(ARGV[4 + 2 * i])
  local level = level_of(KEYS[i], limit)
  levels[i] = level
  if refused == 0 and level < cost then
    refused, wait = i, math.ceil((cost - level) * 60000 / limit)
  end
end
if refused == 0 then
  for j = 1, m do
    redis.call('ZREMRANGEBYSCORE', KEYS[n + j], '-inf', now)
    if refused == 0 and redis.call('ZCARD', KEYS[n + j]) >= tonumber(ARGV[4 + 2 * n + j]) then
      refused, wait = n + j, 1000
    end
  end
end
if refused == 0 then
  for i = 1, n do
    local cost = tonumber(ARGV[4 + 2 * i])
    levels[i] = levels[i] - cost
    store(KEYS[i], tonumber(ARGV[3 + 2 * i]), levels[i], cost)
  end
  for j = 1, m do
    redis.call('ZADD', KEYS[n + j], now + lease_ms, lease)
    redis.call('PEXPIRE', KEYS[n + j], lease_ms)
  end
end
local out = {refused, wait}
for i = 1, n do out[2 + i] = math.floor(levels[i]) end
return out
"""

_SETTLE = _BUCKETS + """
local n, m, lease = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
for i = 1, n do
  local limit, delta = tonumber(ARGV[2 + 2 * i]), tonumber(ARGV[3 + 2 * i])
  store(KEYS[i], limit, math.min(limit, level_of(KEYS[i], limit) - delta), delta)
end
for j = 1, m do redis.call('ZREM', KEYS[n + j], lease) end
return 1
"""


class RateLimited(LoraplaneError):
    """429 in OpenAI's shape: `type` says which limit (requests, tokens), `code` rate_limit_exceeded;
    `retry_after_s` None for a request that can never fit (no retry helps)."""

    status_code = 429

    def __init__(self, message: str, *, kind: str, retry_after_s: float | None,
                 headers: list[tuple[bytes, bytes]]) -> None:
        super().__init__(message, code="rate_limit_exceeded")
        self.error_type = kind
        self.retry_after_s = retry_after_s
        self.headers = headers


class QuotaUnavailable(OverloadedError):
    """503: Redis cannot be reached and the router fails closed."""


@dataclass(frozen=True)
class Bucket:
    key: str
    limit: int
    kind: str  # requests | tokens | concurrent
    who: str  # "tenant x" | "key y", for messages


@dataclass
class Admission:
    """What one admitted request holds until `QuotaStore.settle`."""

    tenant: str
    lease: str = ""
    tokens: list[Bucket] = field(default_factory=list)
    sets: list[str] = field(default_factory=list)
    charged: int = 0  # tokens its token buckets have been charged (the reservation, then what charge adds)
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    requests: list[Bucket] = field(default_factory=list)  # its requests-per-minute buckets (1 each)

    @property
    def counted(self) -> bool:
        return bool(self.tokens or self.sets or self.requests)


def _refuse_too_large(tokens: list[Bucket], reserved: int) -> None:
    """429 for a reservation larger than one of the request's tokens-per-minute buckets holds when full."""
    small = [b for b in tokens if reserved > b.limit]
    if small:
        b = min(small, key=lambda b: b.limit)
        raise RateLimited(f"Request too large for {b.who} on tokens per min (TPM): Limit {b.limit}, Requested "
                          f"{reserved}. It can never fit: lower max_tokens (max_completion_tokens), n or the "
                          "number of prompts, or shorten the prompt.", kind="tokens", retry_after_s=None, headers=[])


def _reset(limit: int, remaining: int) -> bytes:
    """Time until the bucket is full again, as OpenAI writes it (e.g. 1s, 6m0s, 20ms)."""
    seconds = max(0.0, (limit - max(remaining, 0)) * 60 / limit) if remaining < limit else 0.0
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms".encode()
    minutes, rest = divmod(math.ceil(seconds), 60)
    return (f"{minutes}m{rest}s" if minutes else f"{rest}s").encode()


def rate_headers(buckets: list[Bucket], remaining: list[int]) -> list[tuple[bytes, bytes]]:
    """x-ratelimit-{limit,remaining,reset}-{requests,tokens} of the tightest bucket of each kind."""
    headers: list[tuple[bytes, bytes]] = []
    for kind in ("requests", "tokens"):
        mine = [(b, r) for b, r in zip(buckets, remaining, strict=True) if b.kind == kind]
        if not mine:
            continue
        bucket, left = min(mine, key=lambda p: p[1] * 1.0 / p[0].limit)
        headers += [(f"x-ratelimit-limit-{kind}".encode(), str(bucket.limit).encode()),
                    (f"x-ratelimit-remaining-{kind}".encode(), str(max(left, 0)).encode()),
                    (f"x-ratelimit-reset-{kind}".encode(), _reset(bucket.limit, left))]
    return headers


class QuotaStore:
    def __init__(self, redis_url: str | None, prefix: str, *, failure: str, lease_s: float) -> None:
        self.prefix = prefix
        self.failure = failure
        self.lease_ms = int(lease_s * 1000)
        self.client = (aioredis.from_url(redis_url, socket_connect_timeout=0.5, socket_timeout=1.0)
                       if redis_url else None)
        self._admit = self.client.register_script(_ADMIT) if self.client else None
        self._settle = self.client.register_script(_SETTLE) if self.client else None
        self._down_until = 0.0
        self.reachable: bool | None = None  # None before the first ping
        self.last_error: str | None = None

    def plan(self, tenant: str, key_id: str, tenant_limits: Limits, key_limits: Limits
             ) -> tuple[list[Bucket], list[Bucket], list[Bucket]]:
        """(request buckets, token buckets, concurrency sets) that apply."""
        requests, tokens, sets = [], [], []
        for who, name, limits in (("tenant", tenant, tenant_limits), ("key", key_id, key_limits)):
            base = f"{self.prefix}q:{who}:{name}:"
            if limits.requests_per_minute:
                requests.append(Bucket(base + "rpm", limits.requests_per_minute, "requests", f"{who} {name}"))
            if limits.tokens_per_minute:
                tokens.append(Bucket(base + "tpm", limits.tokens_per_minute, "tokens", f"{who} {name}"))
            if limits.concurrent_requests:
                sets.append(Bucket(base + "inflight", limits.concurrent_requests, "concurrent", f"{who} {name}"))
        return requests, tokens, sets

    async def admit(self, tenant: str, key_id: str, tenant_limits: Limits, key_limits: Limits,
                    reserved: int) -> Admission:
        """Admit one request reserving `reserved` tokens, or raise RateLimited / QuotaUnavailable."""
        requests, tokens, sets = self.plan(tenant, key_id, tenant_limits, key_limits)
        if not (requests or tokens or sets):
            return Admission(tenant)  # no quota: nothing to count
        _refuse_too_large(tokens, reserved)
        if self._admit is None or time.monotonic() < self._down_until:
            return self._unavailable(tenant)
        buckets = requests + tokens
        lease = uuid.uuid4().hex
        args: list[int | str] = [len(buckets), len(sets), lease, self.lease_ms]
        for b in buckets:
            args += [b.limit, 1 if b.kind == "requests" else reserved]
        args += [b.limit for b in sets]
        try:
            refused, wait_ms, *remaining = await self._admit(keys=[b.key for b in buckets + sets], args=args)
        except (RedisError, OSError) as exc:
            self._failed(exc)
            return self._unavailable(tenant)
        headers = rate_headers(buckets, [int(r) for r in remaining])
        if refused:
            wait_s = max(1.0, int(wait_ms) / 1000)
            if refused <= len(buckets):
                b = buckets[refused - 1]
                what = "requests per min (RPM)" if b.kind == "requests" else "tokens per min (TPM)"
                message = (f"Rate limit reached for {b.who} on {what}: Limit {b.limit}"
                           + (f", Requested {reserved}" if b.kind == "tokens" else "")
                           + f". Please try again in {wait_s:.0f}s.")
                raise RateLimited(message, kind=b.kind, retry_after_s=wait_s, headers=headers)
            b = sets[refused - len(buckets) - 1]
            raise RateLimited(f"Too many concurrent requests for {b.who}: Limit {b.limit}. Please try again in 1s.",
                              kind="requests", retry_after_s=wait_s, headers=headers)
        return Admission(tenant, lease, tokens, [b.key for b in sets], reserved if tokens else 0, headers, requests)

    def charge(self, admission: Admission, delta: int) -> Coroutine[None, None, None] | None:
        """`delta` tokens more (less when negative) booked now for a request still running; the coroutine
        pays them to the token buckets. Booked at the call, not when the coroutine runs: a settlement that
        runs before it (the stream's end, awaited at once) must count from here, or pay `delta` twice."""
        if not (admission.tokens and delta):
            return None
        admission.charged += delta
        return self._pay(admission, delta, [])

    async def settle(self, admission: Admission, used_tokens: int | None) -> None:
        """Pay what was used, against what was charged (None: unknown, the charges stand); free the leases."""
        if not admission.counted:
            return
        delta = 0 if used_tokens is None else used_tokens - admission.charged
        admission.charged += delta
        await self._pay(admission, delta, admission.sets)

    async def refund(self, admission: Admission) -> None:
        """Give back all a request was charged (no engine accepted it): its request and its tokens in every
        bucket; free the leases."""
        if not admission.counted:
            return
        delta, admission.charged = -admission.charged, 0
        await self._pay(admission, delta, admission.sets, requests=-1)

    async def _pay(self, admission: Admission, delta: int, sets: list[str], *, requests: int = 0) -> None:
        """Every token bucket pays `delta` (a request bucket `requests`); the leases in `sets` go."""
        paid = [(b, delta) for b in admission.tokens] if delta else []
        paid += [(b, requests) for b in admission.requests] if requests else []
        if self._settle is None or not (paid or sets):
            return
        args: list[int | str] = [len(paid), len(sets), admission.lease]
        for b, amount in paid:
            args += [b.limit, amount]
        try:
            await self._settle(keys=[b.key for b, _ in paid] + sets, args=args)
        except (RedisError, OSError) as exc:  # the leases lapse by themselves
            self._failed(exc)

    def _unavailable(self, tenant: str) -> Admission:
        if self.failure == "open":
            return Admission(tenant)
        raise QuotaUnavailable("The quota store (Redis) is unreachable and this router fails closed; retry later.")

    def _failed(self, exc: BaseException) -> None:
        if self.reachable is not False:
            logger.warning("Redis unreachable (%s): quotas fail %s", type(exc).__name__, self.failure)
        self._down_until = time.monotonic() + RETRY_S
        self.reachable = False
        self.last_error = type(exc).__name__

    async def run(self) -> None:
        """Ping Redis every PING_S, so that /health says whether quotas are counted."""
        if self.client is None:
            return
        while True:
            try:
                await self.client.ping()
                if self.reachable is False:
                    logger.info("Redis answers again: quotas are counted")
                self.reachable, self.last_error, self._down_until = True, None, 0.0
            except (RedisError, OSError) as exc:
                self._failed(exc)
            await asyncio.sleep(PING_S)

    def health(self) -> dict[str, object]:
        state = "unconfigured" if self.client is None else {True: "ok", False: "unreachable", None: "unknown"}[
            self.reachable]
        return {"redis": state, "on_failure": self.failure, **({"error": self.last_error} if self.last_error else {})}

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()
