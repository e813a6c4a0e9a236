"""Tenants at the router (--require-api-key): one object for the service to ask, per request,

    caller(authorization, client)    who it is (keys.py): an operator's static key, or a tenant key;
                                     429 past the failed attempts allowed (shared/key_checks.py)
    admit(caller, model, is_base, body, stream, context) → Ticket
                                     404 unless the key may use `model` (access.py); 400 past the
                                     router's --max-request-tokens (usage.py); 429 past a quota,
                                     503 (or an uncounted admission) when Redis is down (quotas.py);
                                     the ticket holds the body to send (asking a stream for its usage),
                                     the x-ratelimit headers and the tap that reads the usage
    settle(ticket, outcome)          the tokens the engine counted, against what was charged; the
                                     concurrency lease freed (in a task of its own: off the answer's path).
                                     Outcome UNSERVED (no engine accepted the request: each refused the
                                     router's credentials or answered 503, or none could be reached) gives
                                     back the request and every token it was charged
                                     The caller settles every ticket it was given, exactly once, whatever
                                     happens after admission (an error, the client leaving)

and what runs beside the requests: the access table's refresh, Redis pings, the revocation listener.

A stream is metered while it runs (`StreamMeter`): each chunk's usage (usage.py) says how many tokens
the request has used so far; what it owes beyond what it has paid (the reservation at admission: the
prompts, estimated when text, plus what every sample may generate) is charged to the token buckets at most every CHARGE_EVERY_S, or at
once past CHARGE_TOKENS, so that one long stream over its tenant's tokens-per-minute quota makes the
tenant's next requests wait on every replica before it ends. The first charge also trues the prompt's
estimate up (or down) to the engine's exact count. A running stream is never cut: like OpenAI's, the
quota is enforced at admission, and what a stream overran is paid back by the requests that follow.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx

from data_plane.router.access import AdapterAccessTable
from data_plane.router.config import RouterConfig
from data_plane.router.errors import model_not_found
from data_plane.router.keys import Caller, KeyVerifier, RevocationListener
from data_plane.router.quotas import Admission, QuotaStore, QuotaUnavailable, RateLimited
from data_plane.router.tenant_metrics import TenantMetrics
from data_plane.router.usage import Usage, UsageTap, ask_for_usage, check_ceiling, reservation
from shared.errors import InvalidRequestError
from shared.key_checks import KeyChecks
from shared.key_secrets import KeyHasher

logger = logging.getLogger(__name__)
CHARGE_EVERY_S = 0.1  # a running stream's tokens reach Redis at most this often …
CHARGE_TOKENS = 128  # … unless it owes this many more
UNSERVED = "unserved"  # the outcome of a request no engine accepted: its quota is given back


@dataclass
class Ticket:
    """One admitted request of a tenant key, until it is settled."""

    admission: Admission
    body: bytes
    tap: UsageTap
    label: str  # the tenant's metric label
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    settled: bool = False


class StreamMeter:
    """Called with each usage a stream's chunks carry; charges what the request owes, in batches."""

    def __init__(self, tenancy: Tenancy, admission: Admission, generated: int) -> None:
        self.tenancy = tenancy
        self.admission = admission
        self.generated = generated  # what the reservation let it generate: paid already, used or not
        self._last = time.monotonic()
        self._charging = False

    def __call__(self, usage: Usage) -> None:
        owed = usage.prompt_tokens + max(self.generated, usage.completion_tokens) - self.admission.charged
        if not owed or self._charging:
            return
        now = time.monotonic()
        if abs(owed) < CHARGE_TOKENS and now - self._last < CHARGE_EVERY_S:
            return
        if (paying := self.tenancy.quotas.charge(self.admission, owed)) is not None:
            self._last, self._charging = now, True
            self.tenancy.spawn(self._pay(paying))

    async def _pay(self, paying: Coroutine[None, None, None]) -> None:
        try:
            await paying
        finally:
            self._charging = False


class Tenancy:
    def __init__(self, config: RouterConfig, control_plane: httpx.AsyncClient, metrics: TenantMetrics) -> None:
        self.required = config.require_api_key
        self.max_request_tokens = config.max_request_tokens
        self.metrics = metrics
        checks = KeyChecks(config.key_failures_per_address, config.key_failures_per_key, config.key_failure_window_s)
        self.keys = KeyVerifier(control_plane, config.api_keys, required=config.require_api_key,
                                ttl_s=config.key_cache_ttl_s, hasher=KeyHasher(config.key_pepper), checks=checks)
        self.access = AdapterAccessTable(control_plane, config.refresh_interval_s)
        self.quotas = QuotaStore(config.redis_url if config.require_api_key else None, config.redis_prefix,
                                 failure=config.quota_failure, lease_s=config.concurrency_lease_s)
        self.revocations = RevocationListener(config.redis_url if config.require_api_key else None,
                                              config.redis_prefix, self.keys)
        self._tasks: set[asyncio.Task[None]] = set()  # charges and settlements under way

    async def start(self) -> list[asyncio.Task[None]]:
        if not self.required:
            return []
        await self.access.refresh()
        return [asyncio.create_task(self.access.run(), name="router:access"),
                asyncio.create_task(self.quotas.run(), name="router:redis-ping"),
                asyncio.create_task(self.revocations.run(), name="router:revocations")]

    async def stop(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.keys.aclose()
        await self.quotas.aclose()

    async def caller(self, authorization: str | None, client: str = "") -> Caller:
        return await self.keys.caller(authorization, client)

    def may_use(self, caller: Caller, model: str, is_base: bool) -> bool:
        return caller.tenant is None or self.access.may_use(caller.tenant, model, is_base)

    async def admit(self, caller: Caller, model: str, is_base: bool, body: bytes, stream: bool,
                    context: int | None) -> Ticket:
        """`context`: the model's context length (the routing table's max_model_len), None when unknown."""
        assert caller.tenant is not None
        label = self.metrics.label(caller.tenant)
        if not self.may_use(caller, model, is_base):
            self.metrics.requests.labels(label, "not_found").inc()
            raise model_not_found(model)  # word for word an unknown model's 404: nothing leaks
        reserved = reservation(body, context)
        try:
            check_ceiling(reserved, self.max_request_tokens)
        except InvalidRequestError:
            self.metrics.requests.labels(label, "too_large").inc()
            raise
        try:
            admission = await self.quotas.admit(caller.tenant, caller.key_id, caller.tenant_limits, caller.limits,
                                                reserved.tokens)
        except RateLimited as exc:
            self.metrics.requests.labels(label, "rate_limited").inc()
            self.metrics.rate_limited.labels(label, exc.error_type).inc()
            raise
        except QuotaUnavailable:
            self.metrics.requests.labels(label, "unavailable").inc()
            self.metrics.quota_failures.labels("refused").inc()
            raise
        if self.quotas.reachable is False and not admission.counted:
            self.metrics.quota_failures.labels("admitted").inc()
        if not stream:
            return Ticket(admission, body, UsageTap(), label, admission.headers)
        if not reserved.asked_continuous:
            body = ask_for_usage(body)
        meter = StreamMeter(self, admission, reserved.generated) if admission.tokens else None
        return Ticket(admission, body, UsageTap(reserved, meter), label, admission.headers)

    def spawn(self, work: Coroutine[None, None, None]) -> None:
        """Run a Redis call off the answer's path (kept until done, awaited at stop)."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def settle(self, ticket: Ticket, outcome: str) -> None:
        """Count the request and its tokens, and settle its quota in a task of its own (once)."""
        if (paying := self._books(ticket, outcome)) is not None:
            self.spawn(paying)

    async def settle_before_end(self, ticket: Ticket, outcome: str = "ok") -> None:
        """`settle` for an answer about to send its last bytes, awaited: a client that sends its next
        request once it has the answer must find the slot free (a tenant allowed one request at a time
        would otherwise be refused between two requests it never ran at once)."""
        if (paying := self._books(ticket, outcome)) is not None:
            await paying

    def _books(self, ticket: Ticket, outcome: str) -> Coroutine[None, None, None] | None:
        """The request counted (once); the quota's settlement to run, if it was counted."""
        if ticket.settled:
            return None
        ticket.settled = True
        self.metrics.requests.labels(ticket.label, outcome).inc()
        usage = ticket.tap.usage
        if usage is not None:
            self.metrics.tokens.labels(ticket.label, "prompt").inc(usage.prompt_tokens)
            self.metrics.tokens.labels(ticket.label, "completion").inc(usage.completion_tokens)
        if not ticket.admission.counted:
            return None
        if outcome == UNSERVED:
            return self.quotas.refund(ticket.admission)
        return self.quotas.settle(ticket.admission, usage.total_tokens if usage is not None else None)

    def health(self) -> dict[str, Any] | None:
        if not self.required:
            return None
        return {"require_api_key": True, "quotas": self.quotas.health(),
                "revocations": "subscribed" if self.revocations.subscribed.is_set() else "not subscribed"}

    def degraded(self) -> str | None:
        """Why /health says degraded, when tenancy is the reason."""
        if self.required and self.quotas.reachable is False:
            what = "refused (503)" if self.quotas.failure == "closed" else "admitted uncounted"
            return f"Redis is unreachable: requests of tenant keys with quotas are {what}"
        return None
