"""Tenants end to end over loopback: `loraplane control` (SQLite) publishing to the real Redis
at 127.0.0.1:6379, one real engine registered with it, and routers with --require-api-key in front: in a
thread of this process (serve_router) or, where two replicas must share a quota, as processes of their own.

Two tenants with a private adapter each and one public adapter: each key lists and uses exactly what it may
through the official openai client (another tenant's adapter is the 404 of a model that does not exist);
a revoked key stops within the bound (at once through Redis; within the key cache TTL without it); two
router processes share one requests-per-minute quota (their admissions add up to it, never more);
Redis unreachable (a closed port) fails closed or open as configured and /health says so; no secret is
in any process's log, in an answer but its creation's, or in the audit trail.

One tenant's completion of many prompts, which fills the engine's batch, delays another tenant's request
beside it by one engine step (the engine's fair share per API request), counted by the engine's own
steps-to-first-token histogram.

Token quotas: the reservation counts every prompt and every sample (n, best_of) of the max_tokens or
the context left (the engines' max_model_len, carried by the routing table); a request that can never
fit a tokens-per-minute limit is refused before any engine work, and one past --max-request-tokens too;
two concurrent requests cannot overrun the quota together; a debt stays in Redis until it is paid back.
A stream whose prompt was underestimated is charged while it runs (seen in Redis while its lease is
held, and by another replica's 429), and what a tenant is charged in the end is the engine's own count
(the openai client's usage, or the engine's token ids), whatever the prompt's estimate at admission
was. A refused key is remembered briefly (no control-plane call per request, counted on the router's own
client; tests/e2e/test_key_guessing.py has what guessing costs). A concurrency slot is free again at
once when the client leaves, or the engine refuses the request. A request that no engine accepted (a
router without the engines' key: each answers 401) costs its tenant nothing and is a 502 saying the
router is misconfigured.

Every test uses its own Redis key prefix and deletes its keys.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.server
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model
from tests.data_plane.api.conftest import SHARED_FLAGS, run_engine, scrape_metric
from tests.data_plane.router.support import serve_router, wait_until
from tests.e2e.test_control_plane_engines import (
    ADMIN,
    CP_TOKENS,
    KEY_PEPPER,
    _free_port,
    control_plane,
    engine_token,
    started,
)

openai = pytest.importorskip("openai")

ROUTER_TOKEN = "router-token-for-tests"  # tests.data_plane.router.support's, which serve_router sends
ENGINE_API_KEY = "e2e-engine-api-key"  # the engine's --api-key (from LORAPLANE_API_KEY), which routers send
REDIS_URL = "redis://127.0.0.1:6379/0"
ONE_TOKEN = {"prompt": "The quick brown fox", "max_tokens": 1, "temperature": 0}
CONTEXT = 256  # the engine's --max-model-len (SHARED_FLAGS)
# a prompt of one token per digit (the tokenizer splits digits): four times its estimate (its bytes / 4)
DIGITS = "7" * 200


@dataclass
class Fleet:
    cp: str
    engine: str  # the engine's URL
    prefix: str
    admin: httpx.Client
    logs: list[Path]
    keys: dict[str, str]  # tenant -> an inference key
    secrets: list[str]  # every key made, to look for in logs

    def make_key(self, tenant: str, **limits: int) -> str:
        r = self.admin.post(f"{self.cp}/v1/tenants/{tenant}/keys", json={"name": "test", "limits": limits})
        assert r.status_code == 201, r.text
        self.secrets.append(r.json()["key"])
        return r.json()["key"]

    def make_tenant(self, name: str, **limits: int) -> str:
        r = self.admin.post(f"{self.cp}/v1/tenants", json={"name": name, "limits": limits})
        assert r.status_code == 201, r.text
        return self.make_key(name)


def redis_ok() -> bool:
    try:
        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if not redis_ok():
        pytest.skip("no Redis at 127.0.0.1:6379")
    tmp = tmp_path_factory.mktemp("tenants")
    base = tmp / "models" / "demo"
    write_demo_model(base, seed=0)
    root = tmp / "adapters"
    paths = write_demo_adapters(base, root)
    prefix = f"lptest:{uuid.uuid4().hex[:8]}:"
    admin = httpx.Client(headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120)
    with contextlib.ExitStack() as stack:
        cp = stack.enter_context(control_plane(tmp, root, LORAPLANE_ROUTER_TOKENS=ROUTER_TOKEN,
                                               LORAPLANE_REDIS_URL=REDIS_URL, LORAPLANE_REDIS_PREFIX=prefix,
                                               LORAPLANE_LOG_LEVEL="info"))
        engine_log = tmp / "e1.log"
        engine = stack.enter_context(run_engine(
            base, engine_log, "--enable-lora", "--lora-roots", str(root), "--admin-token", engine_token("e1"),
            "--control-plane", cp, "--engine-name", "e1", *SHARED_FLAGS, "--heartbeat-interval-s", "0.5",
            env={"LORAPLANE_CONTROL_PLANE_TOKEN": CP_TOKENS["e1"], "LORAPLANE_API_KEY": ENGINE_API_KEY}))
        wait_until(lambda: any(e["state"] == "healthy" for e in admin.get(cp + "/v1/engines").json()["data"]),
                   "the engine to register")
        fleet = Fleet(cp, engine.url, prefix, admin, [tmp / "control.log", engine_log], {}, [])
        for tenant in ("team-a", "team-b"):
            fleet.keys[tenant] = fleet.make_tenant(tenant)
        owners = {"demo-pirate": "team-a", "demo-poet": "team-b", "demo-short": None}
        for name, owner in owners.items():
            r = admin.post(cp + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(paths[name]),
                                                               "base_model": "demo"})
            assert r.status_code == 200, r.text
            r = admin.put(f"{cp}/v1/tenancy/adapters/{name}", json={"owner": owner, "public": owner is None})
            assert r.status_code == 200, r.text
        yield fleet
    client = redis.Redis.from_url(REDIS_URL)
    leftover = list(client.scan_iter(prefix + "*"))
    if leftover:
        client.delete(*leftover)


def client_of(router: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=router + "/v1", api_key=key, max_retries=0, timeout=60)


def tenant_router(fleet: Fleet, **config: object) -> contextlib.AbstractContextManager:
    settings = {"require_api_key": True, "redis_url": REDIS_URL, "redis_prefix": fleet.prefix,
                "engine_api_key": ENGINE_API_KEY, **config}
    return serve_router(fleet.cp, **settings)


def test_each_key_sees_and_uses_exactly_what_it_may(fleet: Fleet) -> None:
    mine = {"team-a": "demo-pirate", "team-b": "demo-poet"}
    with tenant_router(fleet, api_keys=frozenset({"operator-static-key"})) as router:
        wait_until(lambda: len(router.service.tenancy.access.adapters) == 3, "the access table")
        for tenant, key in fleet.keys.items():
            client = client_of(router.url, key)
            assert {m.id for m in client.models.list()} == {"demo", mine[tenant], "demo-short"}
            for model in ("demo", mine[tenant], "demo-short"):
                text = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
                assert text.choices[0].text is not None
            other = next(m for t, m in mine.items() if t != tenant)
            with pytest.raises(openai.NotFoundError) as hidden:
                client.completions.create(model=other, prompt="Hello", max_tokens=4)
            with pytest.raises(openai.NotFoundError) as absent:
                client.completions.create(model="no-such-adapter", prompt="Hello", max_tokens=4)
            # word for word the answer for a model that does not exist: a private adapter's name does not leak
            assert hidden.value.body["message"].replace(other, "X") == absent.value.body["message"].replace(
                "no-such-adapter", "X")
            with pytest.raises(openai.NotFoundError):
                client.models.retrieve(other)
            # a stream the client did not ask usage of has none (the router asked the engine for it)
            chunks = list(client.chat.completions.create(model=mine[tenant], messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=4, stream=True))
            assert chunks and all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
            asked = list(client.completions.create(model=mine[tenant], prompt="hi", max_tokens=3, stream=True,
                                                   stream_options={"include_usage": True}))
            assert asked[-1].usage is not None and not asked[-1].choices
        # an operator's static key: everything; no key, another fleet's key: 401
        operator = client_of(router.url, "operator-static-key")
        assert {m.id for m in operator.models.list()} >= {"demo", "demo-pirate", "demo-poet", "demo-short"}
        for key in ("", "lp_0123456789ab_" + "x" * 43, "not-a-key"):
            r = httpx.post(router.api + "/completions", json={"model": "demo", **ONE_TOKEN},
                           headers={"Authorization": f"Bearer {key}"} if key else {})
            assert r.status_code == 401, r.text
        # Redis is up, so /health says so; a ping that timed out on a loaded machine (1 s bound) may say
        # unreachable until the next ping (every 2 s) answers, which is what the wait allows for
        def healthy() -> bool:
            body = httpx.get(router.url + "/health").json()
            return body["tenancy"]["quotas"]["redis"] == "ok" and body["status"] == "ok"

        wait_until(healthy, "the router's health to say Redis is reachable", timeout_s=10.0)


def test_one_tenants_many_prompts_delay_anothers_first_token_by_one_engine_step(fleet: Fleet) -> None:
    def first_token_steps() -> tuple[float, float]:  # (count, sum) of demo-poet's requests on the engine
        return tuple(scrape_metric(fleet.engine, f"loraplane_time_to_first_token_steps_{part}", 'adapter="demo-poet"')
                     for part in ("count", "sum"))

    with tenant_router(fleet) as router:
        wait_until(lambda: len(router.service.tenancy.access.adapters) == 3, "the access table")
        a, b = client_of(router.url, fleet.keys["team-a"]), client_of(router.url, fleet.keys["team-b"])
        b.completions.create(model="demo-poet", prompt="Hello", max_tokens=1)  # its adapter is in a slot now
        count, total = first_token_steps()
        # 8 prompts x n=16: 128 sequences of 30 tokens, more than the engine's KV cache holds at once
        big = iter(a.completions.create(model="demo-pirate", prompt=["Tell me about the sea"] * 8, n=16,
                                        max_tokens=24, stream=True, temperature=0, extra_body={"ignore_eos": True}))
        next(big)
        small = b.completions.create(model="demo-poet", prompt="Hello", max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
        assert small.usage.completion_tokens == 4
        assert scrape_metric(fleet.engine, "loraplane_running_sequences") > 0  # team-a's request still runs
        after_count, after_total = first_token_steps()
        assert after_count - count == 1 and after_total - total <= 1  # its first token at the next step
        ended = [c.index for chunk in big for c in chunk.choices if c.finish_reason == "length"]
        assert sorted(ended) == list(range(128))


def test_a_revoked_key_stops_within_the_bound(fleet: Fleet) -> None:
    for through_redis in (True, False):
        key = fleet.make_key("team-a")
        key_id = key.split("_")[1]
        # through Redis the message alone can stop it in time (a TTL of a minute); without, the TTL (1 s)
        config: dict[str, object] = {"key_cache_ttl_s": 60.0 if through_redis else 1.0}
        if not through_redis:
            config["redis_url"] = None
        with tenant_router(fleet, **config) as router:
            def works(key: str = key) -> bool:
                r = httpx.post(router.api + "/completions", json={"model": "demo", **ONE_TOKEN},
                               headers={"Authorization": f"Bearer {key}"}, timeout=60)
                assert r.status_code in (200, 401), r.text
                return r.status_code == 200

            if through_redis:
                wait_until(router.service.tenancy.revocations.subscribed.is_set, "the revocation subscription")
            assert works()
            r = fleet.admin.delete(f"{fleet.cp}/v1/tenants/team-a/keys/{key_id}")
            assert r.status_code == 200, r.text
            wait_until(lambda: not works(), "the revoked key to stop", timeout_s=5.0)  # the stated bound
            r = httpx.get(router.api + "/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]


@contextlib.contextmanager
def router_process(cp: str, prefix: str, log: Path, *flags: str, engines: int = 0, pepper: bool = True,
                   **env: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """`loraplane router --require-api-key` as a process of its own (router token, Redis and the key pepper
    from its environment, nothing on its command line; further LORAPLANE_* variables in `env`), once its
    table lists `engines` engines."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")}, "PYTHONUNBUFFERED": "1",
           "LORAPLANE_ROUTER_TOKEN": ROUTER_TOKEN, "LORAPLANE_REDIS_URL": REDIS_URL,
           "LORAPLANE_ENGINE_API_KEY": ENGINE_API_KEY,
           **({"LORAPLANE_KEY_PEPPER": KEY_PEPPER} if pepper else {}), **env}

    def ready() -> bool:
        r = httpx.get(url + "/health", timeout=2)
        return r.status_code == 200 and r.json()["routing_table"]["engines"] >= engines

    cmd = [sys.executable, "-m", "shared.cli", "router", "--control-plane", cp, "--port", str(port),
           "--require-api-key", "--redis-prefix", prefix, *flags]
    with started(cmd, log, env, ready, f"router {url}") as process:
        yield url, process


def test_two_router_processes_share_one_quota(fleet: Fleet, tmp_path: Path) -> None:
    quota = 6
    key = fleet.make_tenant("team-q", requests_per_minute=quota)
    routers = []
    with contextlib.ExitStack() as stack:
        for i in range(2):
            log = tmp_path / f"router-{i}.log"
            fleet.logs.append(log)
            url, _ = stack.enter_context(router_process(fleet.cp, fleet.prefix, log, "--log-level", "debug",
                                                        engines=1))
            routers.append(url)

        def send(i: int) -> httpx.Response:
            return httpx.post(routers[i % 2] + "/v1/completions", json={"model": "demo-short", **ONE_TOKEN},
                              headers={"Authorization": f"Bearer {key}"}, timeout=60)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(send, range(2 * quota + 4)))
        statuses = [r.status_code for r in answers]
        assert set(statuses) <= {200, 429}, [r.text for r in answers if r.status_code not in (200, 429)]
        # the bucket refills at quota/60 per second: at most one more for each 10 s the burst took
        assert statuses.count(200) == quota, statuses
        assert {r.headers["x-ratelimit-limit-requests"] for r in answers} == {str(quota)}
        refused = next(r for r in answers if r.status_code == 429)
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
        assert int(refused.headers["retry-after"]) >= 1 and refused.headers["x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(openai.RateLimitError):
            client_of(routers[0], key).completions.create(model="demo", prompt="x", max_tokens=1)
        metrics = httpx.get(routers[0] + "/metrics").text
        assert 'loraplane_router_tenant_rate_limited_total{limit="requests",tenant="team-q"}' in metrics


def test_redis_unreachable_fails_as_configured_and_health_says_so(fleet: Fleet) -> None:
    quota_key = fleet.make_tenant("team-r", requests_per_minute=1000)
    free_key = fleet.keys["team-a"]  # no quota: Redis is not needed for it
    closed = f"redis://127.0.0.1:{_free_port()}/0"  # nothing listens there
    for failure, quota_status in (("closed", 503), ("open", 200)):
        with tenant_router(fleet, redis_url=closed, quota_failure=failure) as router:
            wait_until(lambda: router.service.tenancy.quotas.reachable is False, "the first ping to fail")
            health = httpx.get(router.url + "/health").json()
            assert health["status"] == "degraded" and "Redis is unreachable" in health["reason"]
            quotas = health["tenancy"]["quotas"]
            assert {k: quotas[k] for k in ("redis", "on_failure")} == {"redis": "unreachable", "on_failure": failure}
            # refused at once, or (a loaded machine stalling the router's loop past the 0.5 s connect bound) timed out
            assert quotas["error"] in ("ConnectionError", "TimeoutError"), quotas
            for key, expected in ((quota_key, quota_status), (free_key, 200)):
                r = httpx.post(router.api + "/completions", json={"model": "demo", **ONE_TOKEN},
                               headers={"Authorization": f"Bearer {key}"}, timeout=60)
                assert r.status_code == expected, (failure, r.text)


def _bucket(fleet: Fleet, tenant: str, kind: str) -> str:
    return f"{fleet.prefix}q:tenant:{tenant}:{kind}"


def charged(fleet: Fleet, tenant: str) -> int:
    """Tokens charged to the tenant's tokens-per-minute bucket (quotas.py counts them beside its level)."""
    return int(redis.Redis.from_url(REDIS_URL).hget(_bucket(fleet, tenant, "tpm"), "charged") or 0)


class LeaseWatch:
    """Samples (tokens charged, the tenant's requests in flight) from Redis atomically, in a thread."""

    def __init__(self, fleet: Fleet, tenant: str) -> None:
        self.keys = (_bucket(fleet, tenant, "tpm"), _bucket(fleet, tenant, "inflight"))
        self.samples: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        client = redis.Redis.from_url(REDIS_URL)
        while not self._stop.is_set():
            pipe = client.pipeline(transaction=True)  # MULTI: one moment of both keys
            pipe.hget(self.keys[0], "charged")
            pipe.zcard(self.keys[1])
            spent, inflight = pipe.execute()
            self.samples.append((int(spent or 0), inflight))
            time.sleep(0.002)

    def __enter__(self) -> LeaseWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)


def test_a_stream_past_its_reservation_is_charged_while_it_runs(fleet: Fleet) -> None:
    quota = 120
    streamer = fleet.make_tenant("team-s", tokens_per_minute=quota, concurrent_requests=100)
    other = fleet.make_key("team-s")
    with tenant_router(fleet) as one, tenant_router(fleet) as two, LeaseWatch(fleet, "team-s") as watch:
        # reserved: the prompt's estimate (51) + max_tokens, within the quota; the prompt is 200 tokens
        stream = client_of(one.url, streamer).completions.create(
            model="demo", prompt=DIGITS, max_tokens=50, stream=True, stream_options={"include_usage": True},
            temperature=0, extra_body={"ignore_eos": True})
        chunks = [next(stream)]
        # the first chunk's usage trues the prompt up: the tenant is past its quota while the stream runs …
        wait_until(lambda: charged(fleet, "team-s") > quota, "the stream's first charge")
        with pytest.raises(openai.RateLimitError) as refused:  # … which the other replica knows
            client_of(two.url, other).completions.create(model="demo", prompt="x", max_tokens=1)
        assert refused.value.body["type"] == "tokens"
        chunks += list(stream)
    final = chunks[-1].usage
    assert final is not None and not chunks[-1].choices and final.completion_tokens == 50
    assert final.prompt_tokens >= len(DIGITS)
    assert all(c.usage is None for c in chunks[:-1])  # the per-chunk usage the router asked for is not shown
    # while the stream still held its lease, it had been charged past the quota; once it ended, exactly
    # the engine's count
    assert max(spent for spent, inflight in watch.samples if inflight == 1) > quota
    wait_until(lambda: charged(fleet, "team-s") == final.total_tokens, "the stream's settlement")


def _post(router: str, key: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(router + "/v1" + path, content=json.dumps(body).encode(), timeout=120,
                      headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


def _estimate(raw: str) -> int:
    """The router's estimate of a prompt it cannot count exactly: its JSON bytes / 4, plus one."""
    return len(raw.encode()) // 4 + 1


def test_the_reservation_counts_every_sample_of_every_prompt(fleet: Fleet) -> None:
    messages = [{"role": "user", "content": "Count the stars"}]
    chat = _estimate(json.dumps(messages))
    cases = [  # (path, body, tokens reserved)
        ("/completions", {"prompt": [[1, 2, 3], [4, 5]], "n": 3, "max_tokens": 7}, 5 + 2 * 3 * 7),
        ("/completions", {"prompt": [5, 6, 7, 8], "n": 2, "max_tokens": 5}, 4 + 2 * 5),
        ("/completions", {"prompt": ["Hello", "Good morning"], "n": 2, "max_tokens": 3},
         _estimate('"Hello"') + _estimate('"Good morning"') + 2 * 2 * 3),
        # best_of samples count when they outnumber n (this engine refuses best_of != n: 400, still reserved)
        ("/completions", {"prompt": [9, 9], "best_of": 3, "max_tokens": 2}, 2 + 3 * 2),
        ("/completions", {"prompt": "Hello"}, _estimate('"Hello"') + 16),  # OpenAI's default max_tokens
        # chat without max_tokens: each sample may run to the context's end
        ("/chat/completions", {"messages": messages, "n": 2}, chat + 2 * (CONTEXT - chat)),
        ("/chat/completions", {"messages": messages, "max_tokens": 100, "max_completion_tokens": 9}, chat + 9),
    ]
    limit = 100_000
    with tenant_router(fleet) as router:
        for path, body, reserved in cases:
            key = fleet.make_key("team-a", tokens_per_minute=limit)  # a fresh bucket: full
            r = _post(router.url, key, path, {"model": "demo", "temperature": 0, **body})
            assert r.status_code in (200, 400) and "x-loraplane-engine" in r.headers, r.text
            # what the bucket held after the admission: the limit less the reservation
            assert int(r.headers["x-ratelimit-remaining-tokens"]) == limit - reserved, (body, r.text)
    # the engine registered its context length; the table carries it for the base model and its adapters
    routes = httpx.get(fleet.cp + "/v1/routes", headers={"Authorization": f"Bearer {ROUTER_TOKEN}"}).json()
    assert {m["model"]: m.get("max_model_len") for m in routes["models"]} == {
        "demo": CONTEXT, "demo-pirate": CONTEXT, "demo-poet": CONTEXT, "demo-short": CONTEXT}
    assert [e.get("max_model_len") for e in fleet.admin.get(fleet.cp + "/v1/engines").json()["data"]] == [CONTEXT]


def test_a_request_larger_than_the_quota_is_refused_before_any_engine_work(fleet: Fleet) -> None:
    quota = 300
    tight = fleet.make_tenant("team-n", tokens_per_minute=quota)
    own = fleet.make_key("team-a", tokens_per_minute=quota)
    samples = {"model": "demo", "prompt": [[1, 2], [3, 4]], "n": 4, "max_tokens": 50}  # 4 + 2 × 4 × 50 tokens
    # no max_tokens: each of the 2 samples may run to the context's end
    context = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "n": 2}
    with tenant_router(fleet) as router:
        for key, who, path, body, reserved in (
                (tight, "tenant team-n", "/completions", samples, 404),
                (tight, "tenant team-n", "/chat/completions", context, None),
                (own, f"key {own.split('_')[1]}", "/completions", samples, 404)):
            r = _post(router.url, key, path, body)
            assert r.status_code == 429, r.text
            error = r.json()["error"]
            assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
            message = error["message"]
            assert who in message and f"Limit {quota}" in message and "never" in message, message
            assert "max_tokens" in message and " n" in message, message
            if reserved is not None:
                assert f"Requested {reserved}" in message, message
            assert "x-loraplane-engine" not in r.headers and "retry-after" not in r.headers
        # nothing was charged (the buckets were never written)
        assert charged(fleet, "team-n") == 0
        assert not redis.Redis.from_url(REDIS_URL).exists(f"{fleet.prefix}q:key:{own.split('_')[1]}:tpm")
        with pytest.raises(openai.RateLimitError) as refused:
            client_of(router.url, tight).completions.create(model="demo", prompt=[[1], [2]], n=2, max_tokens=100)
        assert "never" in refused.value.body["message"]
        # what fits is served
        r = _post(router.url, tight, "/completions", {**samples, "n": 2, "max_tokens": 20})
        assert r.status_code == 200 and r.headers["x-ratelimit-remaining-tokens"] == str(quota - 4 - 2 * 2 * 20)


def test_a_request_past_the_ceiling_is_refused(fleet: Fleet, tmp_path: Path) -> None:
    ceiling = 1000
    many = {"model": "demo", "prompt": [[1]] * 8, "n": 4, "max_tokens": 40}  # 8 + 8 × 4 × 40 tokens
    log = tmp_path / "router.log"
    fleet.logs.append(log)
    with router_process(fleet.cp, fleet.prefix, log, engines=1, LORAPLANE_MAX_REQUEST_TOKENS=str(ceiling),
                        LORAPLANE_API_KEYS="operator-static-key") as (router, _):
        for key in (fleet.keys["team-a"], "operator-static-key"):  # a tenant's key (no quota), an operator's
            r = _post(router, key, "/completions", many)
            assert r.status_code == 400 and "x-loraplane-engine" not in r.headers, r.text
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == "max_tokens"
            assert "--max-request-tokens" in error["message"] and f"{ceiling}" in error["message"]
            assert "1288" in error["message"], error["message"]
            r = _post(router, key, "/completions", {**many, "prompt": [[1]], "max_tokens": 10})
            assert r.status_code == 200, r.text


def test_concurrent_requests_cannot_overrun_the_quota(fleet: Fleet) -> None:
    quota = 1000
    key = fleet.make_tenant("team-o", tokens_per_minute=quota)
    # 6 + 2 × 3 × 149 = 900 tokens: exactly what it uses (token ids are counted exactly; ignore_eos)
    body = {"model": "demo", "prompt": [[1, 2, 3], [4, 5, 6]], "n": 3, "max_tokens": 149, "ignore_eos": True,
            "temperature": 0}
    with tenant_router(fleet) as one, tenant_router(fleet) as two, concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda url: _post(url, key, "/completions", body), (one.url, two.url)))
    assert sorted(r.status_code for r in answers) == [200, 429], [r.text for r in answers]
    served = next(r for r in answers if r.status_code == 200)
    refused = next(r for r in answers if r.status_code == 429).json()["error"]
    assert refused["type"] == "tokens" and "never" not in refused["message"]  # it fits a full bucket
    assert served.json()["usage"]["total_tokens"] == 900
    wait_until(lambda: charged(fleet, "team-o") == 900, lambda: f"900 tokens charged, not {charged(fleet, 'team-o')}")


def test_a_debt_stays_until_it_is_paid_back(fleet: Fleet) -> None:
    quota = 60
    key = fleet.make_tenant("team-d", tokens_per_minute=quota)
    with tenant_router(fleet) as router:
        # reserved: 51 (the prompt's estimate) + 4; used: 200 + 4
        r = _post(router.url, key, "/completions", {"model": "demo", "prompt": DIGITS, "max_tokens": 4,
                                                     "temperature": 0})
        assert r.status_code == 200, r.text
        used = r.json()["usage"]["total_tokens"]
        wait_until(lambda: charged(fleet, "team-d") == used, "the settlement")
        client = redis.Redis.from_url(REDIS_URL)
        pipe = client.pipeline(transaction=True)  # one moment: Redis's clock, the bucket and its TTL
        pipe.time()
        pipe.hmget(_bucket(fleet, "team-d", "tpm"), "level", "at")
        pipe.pttl(_bucket(fleet, "team-d", "tpm"))
        (seconds, micros), (level, at), ttl_ms = pipe.execute()
        now_ms = seconds * 1000 + micros // 1000
        level_now = float(level) + (now_ms - int(at)) * quota / 60_000
        assert level_now < -quota, level_now  # a debt of more than a minute's quota
        full_in_ms = (quota - level_now) * 60_000 / quota  # refilled to full only then
        assert ttl_ms + 2 >= full_in_ms, (ttl_ms, full_in_ms)  # the debt outlives every idle bound
        r = _post(router.url, key, "/completions", {"model": "demo", **ONE_TOKEN})
        assert r.status_code == 429 and r.json()["error"]["type"] == "tokens", r.text


def test_the_tokens_charged_are_the_engines_count(fleet: Fleet) -> None:
    key = fleet.make_tenant("team-t", tokens_per_minute=10**9)
    expected = []
    with tenant_router(fleet) as router:
        client = client_of(router.url, key)
        long_prompt = "The quick brown fox jumps over the lazy dog. " * 8
        r = client.completions.create(model="demo", prompt=long_prompt, max_tokens=5, temperature=0)
        assert r.usage.prompt_tokens != len(long_prompt) // 4 + 1  # the admission's estimate was off
        expected.append(r.usage.total_tokens)
        chat = client.chat.completions.create(model="demo-short", messages=[{"role": "user", "content": long_prompt}],
                                              max_tokens=40, temperature=0, stream=True,
                                              stream_options={"include_usage": True})
        expected.append(list(chat)[-1].usage.total_tokens)
        # a stream that asked for no usage: none shown; the engine's token ids are the oracle
        ids = list(client.completions.create(model="demo", prompt=long_prompt, max_tokens=30, stream=True,
                                             temperature=0, extra_body={"return_token_ids": True}))
        assert all(c.usage is None and c.choices for c in ids)
        expected.append(len(ids[0].choices[0].model_extra["prompt_token_ids"])
                        + sum(len(c.choices[0].model_extra["token_ids"]) for c in ids))
        # a client that asks for continuous usage itself gets every chunk's, as the engine sent it
        every = list(client.completions.create(model="demo", prompt="Hi", max_tokens=6, stream=True,
                                               stream_options={"include_usage": True,
                                                               "continuous_usage_stats": True}))
        assert all(c.usage is not None for c in every) and every[-1].usage.completion_tokens == 6
        expected.append(every[-1].usage.total_tokens)
        wait_until(lambda: charged(fleet, "team-t") == sum(expected),
                   lambda: f"{sum(expected)} tokens charged ({expected}), not {charged(fleet, 'team-t')}")
        metrics = httpx.get(router.url + "/metrics").text
        assert 'loraplane_router_tenant_tokens_total{kind="completion",tenant="team-t"}' in metrics


def test_a_refused_key_is_remembered_briefly(fleet: Fleet) -> None:
    key = fleet.make_key("team-a")
    key_id = key.split("_")[1]
    with tenant_router(fleet) as router:
        asked: list[str] = []

        async def count(request: httpx.Request) -> None:
            if "/tenancy/keys/" in request.url.path:
                asked.append(request.url.path.rsplit("/", 1)[1])

        router.service.control_plane.event_hooks["request"].append(count)
        misses = router.service.tenancy.keys.misses
        misses.ttl_s = 60.0  # long enough that every repeat below falls within it

        def status(offered: str) -> int:
            return httpx.post(router.api + "/completions", json={"model": "demo", **ONE_TOKEN},
                              headers={"Authorization": f"Bearer {offered}"}, timeout=60).status_code

        unknown_id = secrets.token_hex(6)
        wrong_secret = f"lp_{key_id}_{'x' * 43}"
        for offered in (f"lp_{unknown_id}_{'y' * 43}", f"lp_{unknown_id}_{'z' * 43}", wrong_secret,
                        "lp_nothex_short"):
            assert [status(offered) for _ in range(4)] == [401] * 4
        # one control-plane call for the unknown id (any secret), one for the wrong secret's key id (its record is
        # kept for the key cache TTL: each later guess costs an HMAC), none for a malformed key
        assert asked == [unknown_id, key_id]
        assert status(key) == 200 and asked == [unknown_id, key_id]  # the right secret: checked against that record
        # past the TTL the control plane is asked again: a key made with that id would work by then
        misses.ttl_s = 0.2
        later = f"lp_{secrets.token_hex(6)}_{'y' * 43}"
        assert status(later) == 401
        time.sleep(0.3)
        assert status(later) == 401 and asked.count(later.split("_")[1]) == 2


@contextlib.contextmanager
def _raw_request(router_url: str, key: str, body: bytes) -> Iterator[socket.socket]:
    """A request sent on a socket of its own, closed when the block ends (whether answered or not)."""
    host, port = router_url.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + body)
        yield sock


def test_a_slot_is_free_at_once_when_the_client_leaves_or_the_engine_refuses(fleet: Fleet) -> None:
    key = fleet.make_tenant("team-c", concurrent_requests=1)
    inflight = redis.Redis.from_url(REDIS_URL)
    with tenant_router(fleet, concurrency_lease_s=600.0) as router:
        client = client_of(router.url, key)

        def free() -> bool:
            return inflight.zcard(_bucket(fleet, "team-c", "inflight")) == 0

        assert client.completions.create(model="demo", prompt="x", max_tokens=1).choices  # the key is cached now
        # a non-streamed answer starts when it is whole: the client leaves while the router waits for it
        long = b'{"model": "demo", "prompt": "Once", "max_tokens": 240, "n": 4, "ignore_eos": true}'
        with _raw_request(router.url, key, long):
            wait_until(lambda: not free(), "the request's admission")
        registry = router.service.metrics.registry
        wait_until(lambda: registry.get_sample_value("loraplane_router_tenant_requests_total",
                                                     {"tenant": "team-c", "outcome": "abort"}) == 1,
                   "the router to see the client leave before the engine answered")
        wait_until(free, "the slot of the request whose client left (its lease lasts 10 minutes)")
        # the engine refuses (max_tokens past the context): the slot is free for the next request
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="demo", prompt="x", max_tokens=100_000)
        wait_until(free, "the slot of the refused request")
        assert client.completions.create(model="demo", prompt="x", max_tokens=1).choices
        # a client that leaves mid-stream
        stream = client.completions.create(model="demo", prompt="x", max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()
        wait_until(free, "the slot of the stream whose client left")
        # one request at a time is never refused: the slot is free before the answer's last bytes leave
        for i in range(10):
            if i % 2:
                assert client.completions.create(model="demo", prompt="x", max_tokens=1).choices
            else:
                assert list(client.completions.create(model="demo", prompt="x", max_tokens=2, stream=True))


def test_a_request_no_engine_accepted_costs_no_quota_and_says_the_router_is_misconfigured(fleet: Fleet) -> None:
    """A router without the engines' key (the mistake of a router started without LORAPLANE_ENGINE_API_KEY):
    every engine answers 401 to it. The client gets a 502 naming the router's misconfiguration, never the
    engine's words about its key, and its tenant's request and token quotas are given back."""
    quota = 3
    key = fleet.make_tenant("team-m", requests_per_minute=quota, tokens_per_minute=1000, concurrent_requests=1)
    log = []
    with tenant_router(fleet, engine_api_key=None) as router:
        handler = _ListHandler(log)
        logging.getLogger("data_plane.router.proxy").addHandler(handler)
        try:
            answers = [_post(router.url, key, "/completions", {"model": "demo", **ONE_TOKEN})
                       for _ in range(2 * quota)]
        finally:
            logging.getLogger("data_plane.router.proxy").removeHandler(handler)
        for r in answers:
            assert r.status_code == 502, r.text
            error = r.json()["error"]
            assert error["code"] == "router_misconfigured" and "misconfigured" in error["message"], error
            assert "--api-key" not in r.text and "API key" not in r.text, r.text  # the engine's words stay inside
        with pytest.raises(openai.APIStatusError) as refused:
            client_of(router.url, key).completions.create(model="demo", prompt="x", max_tokens=1)
        assert refused.value.status_code == 502
        # the operator's log says which engine refused and what to set
        assert any("e1" in line and "LORAPLANE_ENGINE_API_KEY" in line for line in log), log
    for kind in ("rpm", "tpm"):
        wait_until(lambda kind=kind: int(redis.Redis.from_url(REDIS_URL).hget(_bucket(fleet, "team-m", kind),
                                                                             "charged") or 0) == 0,
                   f"the {kind} charges to be given back")
    assert redis.Redis.from_url(REDIS_URL).zcard(_bucket(fleet, "team-m", "inflight")) == 0
    # with the key, the tenant has its whole quota
    with tenant_router(fleet) as router:
        statuses = [_post(router.url, key, "/completions", {"model": "demo", **ONE_TOKEN}).status_code
                    for _ in range(quota + 1)]
    assert statuses == [200] * quota + [429], statuses


class _Capture(http.server.BaseHTTPRequestHandler):
    """What an engine URL that an admin registered receives: every request's method, path and headers."""

    seen: list[tuple[str, str, dict[str, str]]] = []

    def _record(self) -> None:
        self.seen.append((self.command, self.path, dict(self.headers)))
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        body = json.dumps({"id": "x", "object": "text_completion", "created": 0, "model": "rogue-base",
                           "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}]}).encode()
        self.send_response(200 if self.command == "POST" and self.path.endswith("/completions") else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _record

    def log_message(self, *_: object) -> None:
        pass


def test_an_engine_an_admin_registered_gets_no_engine_api_key(fleet: Fleet) -> None:
    """An engine URL registered with an admin token, not with the engine's own credential: the router sends
    it requests (its served model routes there) but never the engines' inference key, which the
    registered engine e1 keeps getting."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        r = fleet.admin.post(fleet.cp + "/v1/engines/register", json={"name": "rogue", "url": url,
                                                                       "base_model": "rogue-base"})
        assert r.status_code in (200, 201), r.text
        with tenant_router(fleet, api_keys=frozenset({"operator-static-key"})) as router:
            wait_until(lambda: "rogue" in router.service.table.engines, "the table to list the rogue engine")
            assert router.service.table.engines["rogue"].credentialed is False
            assert router.service.table.engines["e1"].credentialed is True
            r = _post(router.url, "operator-static-key", "/completions", {"model": "rogue-base", **ONE_TOKEN})
            assert r.status_code == 200 and r.headers["x-loraplane-engine"] == "rogue", r.text
            r = _post(router.url, "operator-static-key", "/completions", {"model": "demo", **ONE_TOKEN})
            assert r.status_code == 200 and r.headers["x-loraplane-engine"] == "e1", r.text  # e1 has the key
        inference = [headers for method, path, headers in _Capture.seen if path.endswith("/completions")]
        assert inference and all("Authorization" not in h for h in inference), inference
        assert ENGINE_API_KEY not in json.dumps(_Capture.seen)
    finally:
        fleet.admin.delete(fleet.cp + "/v1/engines/rogue")
        server.shutdown()


class _ListHandler(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_an_adapter_nobody_owns_is_usable_only_when_public(fleet: Fleet) -> None:
    with tenant_router(fleet, refresh_interval_s=0.2) as router:
        client = client_of(router.url, fleet.keys["team-a"])

        def listed() -> set[str]:
            return {m.id for m in client.models.list()}

        try:
            r = fleet.admin.put(f"{fleet.cp}/v1/tenancy/adapters/demo-short", json={"owner": None, "public": False})
            assert r.status_code == 200, r.text
            wait_until(lambda: "demo-short" not in listed(), "the access table to drop demo-short")
            with pytest.raises(openai.NotFoundError):
                client.completions.create(model="demo-short", prompt="Hello", max_tokens=2)
        finally:
            r = fleet.admin.put(f"{fleet.cp}/v1/tenancy/adapters/demo-short", json={"owner": None, "public": True})
            assert r.status_code == 200, r.text
        wait_until(lambda: "demo-short" in listed(), "the access table to list demo-short again")
        assert client.completions.create(model="demo-short", prompt="Hello", max_tokens=2).choices


def test_a_keys_own_limits_apply_on_top_of_its_tenants_and_changes_reach_the_router(fleet: Fleet) -> None:
    first = fleet.make_tenant("team-k")
    capped = fleet.make_key("team-k", requests_per_minute=2)
    with tenant_router(fleet, key_cache_ttl_s=60.0) as router:
        wait_until(router.service.tenancy.revocations.subscribed.is_set, "the revocation subscription")

        def status(key: str) -> httpx.Response:
            return httpx.post(router.api + "/completions", json={"model": "demo", **ONE_TOKEN},
                              headers={"Authorization": f"Bearer {key}"}, timeout=60)

        answers = [status(capped) for _ in range(3)]
        assert [r.status_code for r in answers] == [200, 200, 429]
        assert "key " in answers[2].json()["error"]["message"] and status(first).status_code == 200
        # the tenant's new limit reaches the router through Redis (its keys' records are fetched again),
        # well within the 60 s the cache would otherwise keep them
        r = fleet.admin.patch(f"{fleet.cp}/v1/tenants/team-k", json={"limits": {"requests_per_minute": 1}})
        assert r.status_code == 200, r.text
        wait_until(lambda: status(first).status_code == 429, "the tenant's new limit", timeout_s=10)


def test_no_secret_in_logs_answers_or_the_audit_trail(fleet: Fleet) -> None:
    """Runs last in this module: it reads every log the other tests left. Nor is the key pepper anywhere."""
    assert fleet.secrets
    keys = fleet.admin.get(f"{fleet.cp}/v1/tenants/team-a/keys").text
    audit = fleet.admin.get(f"{fleet.cp}/v1/audit", params={"limit": 500}).text
    record = fleet.admin.get(f"{fleet.cp}/v1/tenancy/keys/{fleet.keys['team-a'].split('_')[1]}").text
    logs = "".join(path.read_text() for path in fleet.logs if path.exists())
    assert "create_api_key" in audit and len(logs) > 0 and "secret_hash" in record
    for secret in [key.split("_", 2)[2] for key in fleet.secrets] + [KEY_PEPPER]:
        for where, text in (("key listing", keys), ("audit trail", audit), ("key record", record), ("logs", logs)):
            assert secret not in text, where
