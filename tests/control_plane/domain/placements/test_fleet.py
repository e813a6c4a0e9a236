"""The fleet pass against real engines, with short timings so that the tests run in seconds: engines
stale after 3 s, a reconcile every 1 s.

- a load no engine serves answers with a warning, and is placed when a matching engine registers;
- an engine that dies (SIGKILL) has its adapters held elsewhere within stale-after + 2 intervals, and
  when it returns, rebalancing moves placements back one at a time, never leaving an adapter without
  a loaded replica;
- demand reports above the threshold raise an adapter's replicas to 2 (a second engine loads it), and
  idleness brings them back to min; each decision is audited with its reason and figures.

The engines heartbeat on their own every 3 s, as long as the control plane's stale-after here; a thread
of the test heartbeats for the live ones every 0.25 s (as an admin may), so that only the engine a test
kills goes stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from control_plane.db.models import Adapter, AuditEvent
from control_plane.domain.placements.demand import AdapterDemand, record_demand
from tests.control_plane.conftest import admin, reader
from tests.control_plane.engines import (
    engine_adapters,
    engine_credentials,
    engine_pair,
    lora_engine,
    register_pair,
    served_control_plane,
)
from tests.data_plane.api.conftest import EngineServer
from tests.e2e.test_control_plane_engines import ENGINE_SECRET
from tests.e2e.test_control_plane_engines import _free_port as free_port

STALE_S, INTERVAL_S = 3.0, 1.0


class Heartbeats(threading.Thread):
    """Heartbeats for `names` every 0.25 s (admin token), on a thread of its own: a test that blocks its
    event loop (starting an engine) does not make the other engines stale."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True, name="heartbeats")
        self.url, self.names, self.stop = url, set[str](), threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, headers=admin(), timeout=2) as http:
            while not self.stop.wait(0.25):
                for name in list(self.names):
                    with contextlib.suppress(httpx.HTTPError):
                        http.post(f"/v1/engines/{name}/heartbeat", json={})


@pytest.fixture(scope="module")
def cp_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def engines(demo: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, cp_port: int) -> Iterator[list[EngineServer]]:
    with engine_pair(demo, tmp_path_factory.mktemp("fleet_engines"), f"http://127.0.0.1:{cp_port}") as pair:
        yield pair


@dataclasses.dataclass
class Fleet:
    cp: httpx.AsyncClient
    beats: Heartbeats
    settings: object
    stack: contextlib.ExitStack
    logs: Path
    cp_url: str

    async def start_engine(self, demo: dict, name: str, *flags: str) -> EngineServer:
        """Another engine, registering itself (its start blocks: on a thread)."""
        server = await asyncio.to_thread(self.stack.enter_context, lora_engine(
            demo["base"], demo["root"], self.logs / f"{name}-{time.monotonic_ns()}.log", *flags, name=name,
            control_plane=self.cp_url))
        self.beats.names.add(name)
        return server

    async def detail(self, name: str) -> dict:
        r = await self.cp.get(f"/v1/lora_adapters/{name}", headers=reader())
        assert r.status_code == 200, r.text
        return r.json()

    async def load(self, name: str, path: Path, **extra: object) -> dict:
        r = await self.cp.post("/v1/load_lora_adapter", headers=admin(), json={
            "lora_name": name, "lora_path": str(path), "base_model": "demo", **extra})
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture
async def fleet(settings, engines: list[EngineServer], cp_port: int, tmp_path: Path) -> AsyncIterator[Fleet]:
    settings = dataclasses.replace(settings, engine_token_secret=ENGINE_SECRET, engine_credentials=engine_credentials(),
                                   engine_stale_after_s=STALE_S, reconcile_interval_s=INTERVAL_S,
                                   rebalance_max_moves=1, scale_window_s=2.0, scale_down_idle_s=3.0)
    async with served_control_plane(settings, cp_port) as cp:
        beats = Heartbeats(str(cp.base_url))
        beats.start()
        with contextlib.ExitStack() as stack:
            await register_pair(cp, engines, admin())
            beats.names.update(("ea", "eb"))
            try:
                yield Fleet(cp, beats, settings, stack, tmp_path, str(cp.base_url))
            finally:
                beats.stop.set()
                beats.join(5)


def holding(detail: dict) -> dict[str, dict]:
    """engine -> placement, for the placements desired held."""
    return {p["engine"]: p for p in detail["placements"] if p["desired"] in ("loaded", "pinned")}


def loaded_on(detail: dict) -> set[str]:
    return {e for e, p in holding(detail).items() if p["observed"] == "loaded"}


async def settled(fleet: Fleet, names: list[str]) -> dict[str, set[str]]:
    """Where each adapter is once no placement has changed for three reconcile intervals (rebalancing
    may still be moving some right after the loads): adapter -> its one engine."""
    last, since = None, time.monotonic()
    deadline = since + 60
    while time.monotonic() < deadline:
        now = {n: loaded_on(d) if len(holding(d := await fleet.detail(n))) == 1 else set() for n in names}
        if now != last or not all(now.values()):
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 3 * INTERVAL_S:
            return now
        await asyncio.sleep(0.2)
    pytest.fail(f"placements did not settle: {last}")


async def until(predicate, timeout_s: float, what: str) -> float:  # noqa: ANN001
    """Poll `predicate` (async) every 0.1 s; the seconds it took. Fails with `what` after `timeout_s`."""
    start = time.monotonic()
    while not await predicate():
        assert time.monotonic() - start < timeout_s, f"{what}: not after {timeout_s}s"
        await asyncio.sleep(0.1)
    return time.monotonic() - start


async def test_an_adapter_nobody_serves_is_placed_when_a_matching_engine_registers(fleet: Fleet, demo: dict) -> None:
    r = await fleet.cp.post("/v1/load_lora_adapter", headers=admin(), json={
        "lora_name": "early", "lora_path": str(demo["demo-poet"]), "base_model": "late-base"})
    assert r.status_code == 200, r.text
    assert r.json()["engines"] == [] and "no engine serves base model 'late-base' yet" in r.json()["warning"]
    assert holding(await fleet.detail("early")) == {}
    late = await fleet.start_engine(demo, "ec", "--served-model-name", "late-base")  # registers itself

    async def placed() -> bool:
        return "ec" in loaded_on(await fleet.detail("early"))

    await until(placed, 60, "the adapter placed on the engine that registered")
    assert "early" in engine_adapters(late, "ec") and set(holding(await fleet.detail("early"))) == {"ec"}
    served = httpx.post(late.api + "/completions", timeout=60,
                        json={"model": "early", "prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert served.status_code == 200, served.text


async def test_a_dead_engines_adapters_move_within_the_bound_and_come_back_bounded(fleet: Fleet, demo: dict) -> None:
    ec = await fleet.start_engine(demo, "ec")
    names = [f"moving-{i}" for i in range(6)]
    for name in names:
        body = await fleet.load(name, demo["demo-short"], replicas={"min": 1, "max": 1})
        assert len(body["engines"]) == 1  # one engine each, not every engine
    # pinned: rebalancing leaves it on ec until ec dies
    await fleet.load("on-ec", demo["demo-pirate"], replicas={"min": 1, "max": 1}, engines=["ec"], pinned=True)
    names.append("on-ec")
    before = await settled(fleet, names)
    victims = [n for n, h in before.items() if h == {"ec"}]
    assert "on-ec" in victims

    fleet.beats.names.discard("ec")
    ec.process.kill()  # SIGKILL: no drain, no goodbye; its last heartbeat is at most 0.25 s old
    ec.process.wait()

    async def replaced() -> bool:
        details = {n: await fleet.detail(n) for n in names}
        for n, d in details.items():  # the others are served throughout (they may be rebalanced, not dropped)
            assert n in victims or loaded_on(d) - {"ec"}, (n, d)
        return all(loaded_on(details[n]) - {"ec"} for n in victims)

    took = await until(replaced, 30, "the dead engine's adapters held elsewhere")
    # within stale-after + 2 reconcile intervals (+ 1 s for the load itself and this poll)
    assert took <= STALE_S + 2 * INTERVAL_S + 1.0, took

    # ec comes back: rebalancing moves placements onto it, one move at a time (rebalance_max_moves=1),
    # each adapter keeping a loaded replica throughout
    await fleet.start_engine(demo, "ec")
    deadline, most_moving = time.monotonic() + 40, 0
    while time.monotonic() < deadline:
        details = {n: await fleet.detail(n) for n in names}
        assert all(loaded_on(d) - {"ec"} or "ec" in loaded_on(d) for d in details.values()), details
        most_moving = max(most_moving, sum(len(holding(d)) > 1 for d in details.values()))
        if any("ec" in loaded_on(d) and len(holding(d)) == 1 for d in details.values()):
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail("no placement moved back onto the returning engine")
    assert most_moving <= 1


async def test_demand_adds_a_replica_and_idleness_takes_it_back(fleet: Fleet, demo: dict, settings) -> None:
    await fleet.load("busy", demo["demo-poet"], replicas={"min": 1, "max": 2})
    assert len(holding(await fleet.detail("busy"))) == 1
    db = create_async_engine(settings.database_url)
    sessions = async_sessionmaker(db, expire_on_commit=False)
    async with sessions() as session:
        adapter_id = await session.scalar(select(Adapter.id).where(Adapter.name == "busy"))
    stop = asyncio.Event()

    async def report() -> None:  # what a router with 20 requests queued for the adapter sends
        while not stop.is_set():
            async with sessions() as session:
                await record_demand(session, "router:test", [AdapterDemand(adapter_id, waiting=20, running=0)])
                await session.commit()
            await asyncio.sleep(0.3)

    reporter = asyncio.create_task(report())
    try:
        async def two() -> bool:
            d = await fleet.detail("busy")
            return d["replicas"]["target"] == 2 and loaded_on(d) == {"ea", "eb"}

        await until(two, 30, "a second replica for the busy adapter")
    finally:
        stop.set()
        await reporter
    d = await fleet.detail("busy")
    up = d["last_decision"]
    assert (up["from"], up["to"]) == (1, 2) and "above 8" in up["reason"]
    assert up["figures"]["waiting"] >= 20 and up["figures"]["load_per_replica"] > 8
    for server in (await fleet.cp.get("/v1/engines", headers=reader())).json()["data"]:
        assert server["state"] == "healthy"

    async def back_to_min() -> bool:
        d = await fleet.detail("busy")
        return d["replicas"]["target"] == 1 and len(holding(d)) == 1

    await until(back_to_min, 30, "the busy adapter back to one replica once idle")
    down = (await fleet.detail("busy"))["last_decision"]
    assert (down["from"], down["to"]) == (2, 1) and "no requests" in down["reason"]
    async with sessions() as session:
        events = (await session.scalars(select(AuditEvent).where(AuditEvent.action == "scale_lora_adapter")
                                        .order_by(AuditEvent.id))).all()
    await db.dispose()
    assert [(e.actor, e.target, e.outcome) for e in events] == [
        ("control-plane", "busy", "ok 1->2"), ("control-plane", "busy", "ok 2->1")]
    assert events[0].detail["figures"]["waiting"] >= 20 and events[1].detail["reason"] == down["reason"]
