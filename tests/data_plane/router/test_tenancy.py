"""A tenant's tokens are charged once: a running stream's charges (StreamMeter) and its settlement at the
end add up to the engine's count, against the real Redis at 127.0.0.1:6379, in whatever order their
Redis calls run."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
import redis
from prometheus_client import CollectorRegistry

from data_plane.router.config import RouterConfig
from data_plane.router.tenancy import CHARGE_TOKENS, StreamMeter, Tenancy
from data_plane.router.tenant_metrics import TenantMetrics
from data_plane.router.usage import Usage
from shared.tenants import Limits
from tests.e2e.test_tenants import REDIS_URL, redis_ok

RESERVED = 10  # the admission's estimate: prompt + max_tokens
GENERATED = 5  # of which max_tokens
LIMITS = Limits(tokens_per_minute=10**6)  # the tenant's: a token bucket, never in the way


@pytest.fixture
async def tenancy() -> AsyncIterator[Tenancy]:
    if not redis_ok():
        pytest.skip("no Redis at 127.0.0.1:6379")
    prefix = f"lptest:{uuid.uuid4().hex[:8]}:"
    config = RouterConfig(control_plane_url="http://127.0.0.1:9", require_api_key=True, redis_url=REDIS_URL,
                          redis_prefix=prefix)
    async with httpx.AsyncClient() as control_plane:
        tenancy = Tenancy(config, control_plane, TenantMetrics(CollectorRegistry(), max_labels=10))
        yield tenancy
        await tenancy.stop()
    client = redis.Redis.from_url(REDIS_URL)
    if keys := list(client.scan_iter(prefix + "*")):
        client.delete(*keys)


def charged(tenancy: Tenancy, tenant: str) -> int:
    """Tokens charged to the tenant's tokens-per-minute bucket, the one QuotaStore.plan names."""
    (bucket,) = tenancy.quotas.plan(tenant, "k", LIMITS, Limits())[1]
    return int(redis.Redis.from_url(REDIS_URL).hget(bucket.key, "charged") or 0)


@pytest.mark.parametrize("charge_runs_first", [False, True])
async def test_a_charge_just_before_the_end_is_paid_once(tenancy: Tenancy, charge_runs_first: bool) -> None:
    admission = await tenancy.quotas.admit("t", "k", LIMITS, Limits(), RESERVED)
    assert charged(tenancy, "t") == RESERVED
    meter = StreamMeter(tenancy, admission, GENERATED)
    # the stream's last usage chunk owes more than CHARGE_TOKENS: its charge is spawned at once …
    final = Usage(prompt_tokens=CHARGE_TOKENS + 50, completion_tokens=GENERATED)
    final.total_tokens = final.prompt_tokens + final.completion_tokens
    meter(final)
    while charge_runs_first and charged(tenancy, "t") == RESERVED:  # the charge reached Redis
        await asyncio.sleep(0.01)
    # … and [DONE] follows: the settlement is awaited there and then (settle_before_end), which may run
    # before the charge's task has
    await tenancy.quotas.settle(admission, final.total_tokens)
    await tenancy.stop()  # the charge's task done, whenever it ran
    assert charged(tenancy, "t") == final.total_tokens


async def test_a_request_no_engine_accepted_gives_back_all_it_was_charged(tenancy: Tenancy) -> None:
    limits = Limits(requests_per_minute=2, tokens_per_minute=100, concurrent_requests=1)
    client = redis.Redis.from_url(REDIS_URL)
    requests, tokens, sets = tenancy.quotas.plan("t", "k", limits, Limits())
    for _ in range(5):  # more than the quota allows, were they charged
        admission = await tenancy.quotas.admit("t", "k", limits, Limits(), RESERVED)
        assert client.zcard(sets[0].key) == 1 and int(client.hget(tokens[0].key, "charged")) == RESERVED
        await tenancy.quotas.refund(admission)
        assert client.zcard(sets[0].key) == 0
        assert {int(client.hget(b.key, "charged")) for b in requests + tokens} == {0}
        assert admission.charged == 0
