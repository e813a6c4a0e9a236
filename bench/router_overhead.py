"""The router's own cost in front of a real engine: 1-token latency and streaming throughput.

    .venv/bin/python bench/router_overhead.py [--repeats 3] [--requests 200] [--streams 8] [--stream-tokens 128]

Real processes on loopback, all on this machine (CPU): `loraplane control` (SQLite), one `loraplane engine
--control-plane …` on the demo model with one adapter loaded through the control plane, and `loraplane
router` pointed at the control plane. Each repeat measures, alternating the router and the engine itself
request by request (1-token) or run by run (streams), so that both see the same machine:

- p50 of a 1-token non-streaming completion of the adapter, via the router and direct; the overhead is
  their difference (target ≤ 2 ms);
- output tokens/s of --streams concurrent streams of --stream-tokens tokens, via the router over direct
  (target ≥ 0.95);
- tenant keys: a second router with --require-api-key and Redis (127.0.0.1:6379, a prefix of
  its own, deleted at the end) serves a tenant key whose tenant and key have requests, tokens and
  concurrency quotas (large enough never to refuse); the p50 of 1-token completions through it and
  through the plain router, alternated request by request: what key checks and quotas add (target ≤ 1 ms);
  and the streams' tokens/s through it over the plain router, run by run (the router meters every chunk of
  a tenant's stream: vLLM's continuous usage, taken out again, and a Redis charge every 100 ms).

Prints one JSON object; figures are medians over the repeats with [min, max].
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import redis
from stack import (  # bench/stack.py: run as `python bench/router_overhead.py`
    engine_admin_token,
    free_port,
    process,
)

from data_plane.demo.adapters import DemoAdapter, write_lora_adapter
from data_plane.demo.model_builder import write_demo_model
from data_plane.lora.weights import TARGET_MODULES

ENGINE = "bench-engine"
REDIS_URL = "redis://127.0.0.1:6379/0"
ADAPTER = "a00"
ENGINE_FLAGS = ("--device", "cpu", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-model-len",
                "512", "--num-kv-blocks", "512", "--log-level", "warning")


def spread(values: list[float], digits: int) -> dict:
    return {"median": round(statistics.median(values), digits),
            "range": [round(min(values), digits), round(max(values), digits)]}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "shared.cli", *args]


@contextlib.contextmanager
def running(tmp: Path) -> Iterator[tuple[str, str, str, str]]:
    """Control plane, engine (the adapter loaded through the control plane), the router, and a router with
    --require-api-key; yields (router, engine, tenant router, tenant key)."""
    base = tmp / "base"
    write_demo_model(base, seed=0)
    adapter = write_lora_adapter(base, tmp / "adapters" / ADAPTER,
                                 DemoAdapter(r=8, lora_alpha=16, target_modules=TARGET_MODULES), seed=100)
    admin, router_token, engine_admin, engine_cp = (secrets.token_urlsafe(16) for _ in range(4))
    pepper = secrets.token_urlsafe(32)  # tenant keys' hashes: the control plane's and the tenant router's
    cp, engine, router, tenant_router = (f"http://127.0.0.1:{free_port()}" for _ in range(4))
    prefix = f"lpbench:{secrets.token_hex(4)}:"
    cp_env = {**os.environ, "LORAPLANE_REDIS_URL": REDIS_URL, "LORAPLANE_REDIS_PREFIX": prefix,
              "LORAPLANE_ADMIN_TOKENS": admin, "LORAPLANE_ROUTER_TOKENS": router_token,
              "LORAPLANE_ENGINE_ADMIN_TOKEN": engine_admin, "LORAPLANE_ENGINE_CREDENTIALS": f"{ENGINE}={engine_cp}",
              "LORAPLANE_DATABASE_URL": f"sqlite:///{tmp / 'cp.db'}", "LORAPLANE_LOG_LEVEL": "warning",
              "LORAPLANE_KEY_PEPPER": pepper}
    engine_env = {**os.environ, "LORAPLANE_ADMIN_TOKEN": engine_admin_token(engine_admin, ENGINE),
                  "LORAPLANE_CONTROL_PLANE_TOKEN": engine_cp}
    with contextlib.ExitStack() as stack:
        stack.enter_context(process(cli("control", "--port", cp.rsplit(":", 1)[1], "--lora-roots", str(tmp)),
                                    cp_env, tmp / "control.log", cp))
        stack.enter_context(process(cli("engine", "--model", str(base), "--served-model-name", "demo", "--port",
                                        engine.rsplit(":", 1)[1], "--control-plane", cp, "--engine-name", ENGINE,
                                        "--lora-cache-dir", str(tmp / "cache"), *ENGINE_FLAGS),
                                    engine_env, tmp / "engine.log", engine))
        with httpx.Client(base_url=cp, headers={"Authorization": f"Bearer {admin}"}, timeout=120) as client:
            deadline = time.monotonic() + 60
            while not any(e["name"] == ENGINE and e["state"] == "healthy" for e in client.get("/v1/engines").json()["data"]):
                if time.monotonic() > deadline:
                    raise SystemExit("the engine did not register with the control plane")
                time.sleep(0.2)
            r = client.post("/v1/load_lora_adapter", json={"lora_name": ADAPTER, "lora_path": str(adapter),
                                                           "base_model": "demo"})
            if r.status_code != 200:
                raise SystemExit(f"loading {ADAPTER} answered {r.status_code}: {r.text[:300]}")
            huge = {"requests_per_minute": 10**9, "tokens_per_minute": 10**12, "concurrent_requests": 10**6}
            client.post("/v1/tenants", json={"name": "bench", "limits": huge}).raise_for_status()
            key = client.post("/v1/tenants/bench/keys", json={"name": "bench", "limits": huge}).json()["key"]
            client.put(f"/v1/tenancy/adapters/{ADAPTER}", json={"owner": "bench"}).raise_for_status()
        stack.enter_context(process(cli("router", "--control-plane", cp, "--port", router.rsplit(":", 1)[1],
                                        "--log-level", "warning"),
                                    {**os.environ, "LORAPLANE_ROUTER_TOKEN": router_token}, tmp / "router.log", router))
        stack.enter_context(process(cli("router", "--control-plane", cp, "--port", tenant_router.rsplit(":", 1)[1],
                                        "--log-level", "warning", "--require-api-key", "--redis-prefix", prefix),
                                    {**os.environ, "LORAPLANE_ROUTER_TOKEN": router_token,
                                     "LORAPLANE_REDIS_URL": REDIS_URL, "LORAPLANE_KEY_PEPPER": pepper},
                                    tmp / "tenant-router.log", tenant_router))
        stack.callback(forget_redis, prefix)
        for url, headers in ((router, {}), (tenant_router, {"Authorization": f"Bearer {key}"})):
            deadline = time.monotonic() + 60
            while httpx.post(f"{url}/v1/completions", timeout=60, headers=headers,
                             json={"model": ADAPTER, "prompt": "hi", "max_tokens": 1}).status_code != 200:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{url} does not serve {ADAPTER}; see the router logs in {tmp}")
                time.sleep(0.5)
        yield router, engine, tenant_router, key


def forget_redis(prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(prefix + "*"))
    if keys:
        client.delete(*keys)


async def one_token(http: httpx.AsyncClient, url: str, key: str | None = None) -> float:
    body = {"model": ADAPTER, "prompt": "hello", "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    r = await http.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"} if key else {})
    if r.status_code != 200:
        raise SystemExit(f"{url} answered {r.status_code}: {r.text[:300]}")
    return time.perf_counter() - started


async def overhead(router: str, engine: str, n: int, key: str | None = None) -> tuple[float, float]:
    """p50 seconds of a 1-token completion via `router` (with `key`) and via `engine` (another URL,
    without one), alternated request by request."""
    via, direct = [], []
    async with httpx.AsyncClient(timeout=60) as http:
        for _ in range(10):  # warm: connections open on both paths
            await one_token(http, router, key)
            await one_token(http, engine)
        for _ in range(n):
            via.append(await one_token(http, router, key))
            direct.append(await one_token(http, engine))
    return statistics.median(via), statistics.median(direct)


async def stream_one(http: httpx.AsyncClient, url: str, tokens: int, key: str | None) -> int:
    body = {"model": ADAPTER, "prompt": "once upon a time", "max_tokens": tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    seen = 0
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url} answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                seen += 1
    return seen


async def streaming(url: str, streams: int, tokens: int, key: str | None = None) -> float:
    """Output tokens/s of `streams` concurrent streams (with `key`)."""
    async with httpx.AsyncClient(timeout=600) as http:
        started = time.perf_counter()
        counts = await asyncio.gather(*(stream_one(http, url, tokens, key) for _ in range(streams)))
        return sum(counts) / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200, help="1-token requests per path and repeat")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=128)
    parser.add_argument("--stream-runs", type=int, default=2, help="router/direct stream run pairs per repeat")
    args = parser.parse_args()
    via_p50, direct_p50, ratios, via_tps, direct_tps, tenant_p50, plain_p50 = [], [], [], [], [], [], []
    tenant_ratios: list[float] = []
    with tempfile.TemporaryDirectory() as tmp_name, running(Path(tmp_name)) as (router, engine, tenant_router, key):
        asyncio.run(streaming(router, args.streams, 16))  # warm-up, not counted
        asyncio.run(streaming(engine, args.streams, 16))
        asyncio.run(streaming(tenant_router, args.streams, 16, key))
        for rep in range(args.repeats):
            via, direct = asyncio.run(overhead(router, engine, args.requests))
            via_p50.append(1e3 * via)
            direct_p50.append(1e3 * direct)
            keyed, plain = asyncio.run(overhead(tenant_router, router, args.requests, key))
            tenant_p50.append(1e3 * keyed)
            plain_p50.append(1e3 * plain)
            pairs = []
            for run in range(args.stream_runs):  # which path goes first alternates
                order = (router, engine) if (rep + run) % 2 == 0 else (engine, router)
                tps = {url: asyncio.run(streaming(url, args.streams, args.stream_tokens)) for url in order}
                pairs.append((tps[router], tps[engine]))
            via_tps.append(statistics.mean(p[0] for p in pairs))
            direct_tps.append(statistics.mean(p[1] for p in pairs))
            ratios.append(via_tps[-1] / direct_tps[-1])
            keyed_pairs = []
            for run in range(args.stream_runs):
                order = ((tenant_router, key), (router, None))
                order = order if (rep + run) % 2 == 0 else order[::-1]
                tps = {url: asyncio.run(streaming(url, args.streams, args.stream_tokens, k)) for url, k in order}
                keyed_pairs.append(tps[tenant_router] / tps[router])
            tenant_ratios.append(statistics.mean(keyed_pairs))
    print(json.dumps({
        "benchmark": "router_overhead",
        "machine": f"CPU only, {os.cpu_count()} cores shared by the control plane, the engine, the router and the client",
        "setup": {"engine": "demo model (Qwen2-style, 4 layers, hidden 256), one rank-8 adapter", "repeats": args.repeats,
                  "requests": args.requests, "streams": args.streams, "stream_tokens": args.stream_tokens},
        "overhead_1_token_p50_ms": spread([v - d for v, d in zip(via_p50, direct_p50, strict=True)], 2) | {
            "via_router_ms": spread(via_p50, 2), "direct_ms": spread(direct_p50, 2), "target": "<= 2"},
        "streaming_throughput_ratio": spread(ratios, 3) | {
            "via_router_tokens_per_s": spread(via_tps, 1), "direct_tokens_per_s": spread(direct_tps, 1),
            "target": ">= 0.95"},
        "keys_and_quotas_added_1_token_p50_ms": spread([t - p for t, p in zip(tenant_p50, plain_p50, strict=True)], 2)
        | {"tenant_key_router_ms": spread(tenant_p50, 2), "plain_router_ms": spread(plain_p50, 2), "target": "<= 1"},
        "tenant_key_streaming_over_plain_router": spread(tenant_ratios, 3),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
