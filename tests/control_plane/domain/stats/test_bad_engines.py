"""One slow, broken or hostile engine is one bad row: GET /v1/lora_stats and reconciles stay fast and 200.

A real engine next to misbehaving peers on loopback (a dripping one, one answering `[1,2,3]`, one with
unparseable /metrics), with the control plane's engine deadline at 1 s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from litestar.testing import AsyncTestClient

from control_plane.app import create_app
from tests.control_plane.conftest import admin, reader
from tests.control_plane.domain.engines.peers import Peer, Reply, always, json_reply, serve
from tests.control_plane.engines import lora_engine
from tests.data_plane.api.conftest import EngineServer
from tests.e2e.test_control_plane_engines import ENGINE_SECRET

DEADLINE_S = 2.0  # the good engine answers well within it even on a loaded 2-core machine
# Far from both sides: a deadline-bound call takes ~DEADLINE_S (a few more on a loaded CI machine),
# while the drip alone would take 40 s (and before the deadline, lora_stats took 181 s on such an engine).
# The per-engine error below says which deadline cut the call off.
BOUND_S = 15.0
STATS = {"base": {"name": "demo", "id": 0}, "adapters": [{"name": "odd", "id": 7, "requests": {"ok": 2}}]}


@pytest.fixture(scope="module")
def engine(demo: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    with lora_engine(demo["base"], demo["root"], tmp_path_factory.mktemp("bad_engines") / "e.log",
                     name="good") as server:
        yield server


@pytest.fixture(scope="module")
def peers() -> Iterator[dict[str, Peer]]:
    def bad_metrics(_method: str, path: str) -> Reply:
        if path == "/metrics":
            return Reply(body=b'loraplane_e2e_request_latency_seconds_bucket{adapter="odd",le="x"} nan nan\n{{{',
                         headers={"content-type": "text/plain"})
        return json_reply(STATS if path == "/v1/lora_stats" else {"adapters": []})

    with serve(always(Reply(body=b"{" + b" " * 200 + b"}", drip_s=0.2))) as drip, \
            serve(always(json_reply([1, 2, 3]))) as garbage, serve(bad_metrics) as metrics:
        yield {"drip": drip, "garbage": garbage, "metrics": metrics}


@pytest.fixture
async def cp(settings, engine: EngineServer, peers: dict[str, Peer]) -> AsyncIterator[AsyncTestClient]:
    app = create_app(dataclasses.replace(settings, engine_token_secret=ENGINE_SECRET, engine_timeout_s=DEADLINE_S))
    async with AsyncTestClient(app=app) as c:
        for name, url in [("good", engine.url)] + [(n, p.url) for n, p in peers.items()]:
            body = {"name": name, "url": url, "base_model": "demo", "slots_total": 4}
            assert (await c.post("/v1/engines/register", json=body, headers=admin())).status_code == 200
        # each registration starts a round of its engine's; one still running holds that engine's row, and a
        # reconcile then rightly skips it (another round has it): the tests' own rounds come after them
        deadline = time.monotonic() + 60
        while app.state.reconciler._kicks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        yield c


async def test_lora_stats_answers_for_the_fleet_with_one_row_per_bad_engine(cp: AsyncTestClient,
                                                                           engine: EngineServer) -> None:
    r = httpx.post(engine.api + "/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    start = time.monotonic()
    r = await cp.get("/v1/lora_stats", headers=reader())
    assert r.status_code == 200, r.text
    assert time.monotonic() - start < BOUND_S  # the drip would take 40 s
    errors = {e["engine"]: e["error"] for e in r.json()["engines"]}
    assert errors["good"] is None
    assert f"no complete answer within {DEADLINE_S:g} s" in errors["drip"]
    assert "not a valid reply" in errors["garbage"]
    assert "/metrics" in errors["metrics"]
    # the engine with unparseable /metrics still gives its counters, without latency figures
    [odd] = [a for a in r.json()["adapters"] if a["name"] == "odd"]
    assert odd["requests"] == {"ok": 2} and odd["e2e_seconds"]["samples"] == 0


async def test_a_reconcile_round_is_not_held_up_or_broken_by_bad_engines(cp: AsyncTestClient) -> None:
    start = time.monotonic()
    r = await cp.post("/v1/engines/reconcile", headers=admin())
    assert r.status_code == 200, r.text
    assert time.monotonic() - start < BOUND_S  # the drip's reads alone would take 40 s
    skipped = {e["engine"]: e["skipped"] for e in r.json()["engines"]}
    assert skipped == {"good": False, "drip": True, "garbage": True, "metrics": False}
