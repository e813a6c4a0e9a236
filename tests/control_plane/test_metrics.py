"""The control plane's push and reconcile series (control_plane/metrics.py) against a real engine: a load's
push is counted by outcome, a reconcile round that finds the engine lost an adapter counts as changed with
a drift of one and a reconcile load, and the round after it as converged with no drift."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.control_plane.conftest import admin
from tests.control_plane.engines import (
    engine_credentials,
    lora_engine,
    registered_themselves,
    served_control_plane,
)
from tests.data_plane.api.conftest import EngineServer, scrape_metric
from tests.e2e.test_control_plane_engines import ENGINE_SECRET, engine_auth
from tests.e2e.test_control_plane_engines import _free_port as free_port


@pytest.fixture(scope="module")
def cp_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def engine(demo: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, cp_port: int) -> Iterator[EngineServer]:
    with lora_engine(demo["base"], demo["root"], tmp_path_factory.mktemp("metrics") / "e.log", name="ea",
                     control_plane=f"http://127.0.0.1:{cp_port}") as server:
        yield server


async def test_push_and_reconcile_outcomes_and_drift(settings, engine: EngineServer, demo: dict, cp_port: int) -> None:
    settings = dataclasses.replace(settings, engine_token_secret=ENGINE_SECRET, engine_credentials=engine_credentials(),
                                   reconcile_interval_s=3600)  # rounds only when the test asks for one
    async with served_control_plane(settings, cp_port) as cp:
        url = str(cp.base_url).rstrip("/")

        def metric(name: str, labels: str) -> float:
            return scrape_metric(url, name, labels)

        calls = "loraplane_control_engine_calls_total"
        rounds = "loraplane_control_reconcile_rounds_total"
        assert metric(calls, 'source="reconcile",action="unload",outcome="failed"') == 0  # zeros from the start
        # the engine registers itself here, which kicks one round: wait for both, so that no round but
        # those the test asks for runs from now on (a kicked round beside them would fix the drift first)
        await registered_themselves(cp, {"ea": engine.url}, admin())
        deadline = time.monotonic() + 30
        while metric(rounds, 'result="changed"') + metric(rounds, 'result="converged"') < 1:
            assert time.monotonic() < deadline, "the registration's reconcile round did not run"
            await asyncio.sleep(0.05)
        name = f"metrics-{uuid.uuid4().hex[:8]}"  # the engine outlives each database of the module
        r = await cp.post("/v1/load_lora_adapter", headers=admin(),
                          json={"lora_name": name, "lora_path": str(demo["demo-short"]), "base_model": "demo"})
        assert r.status_code == 200 and r.json()["engines"][0]["outcome"] == "loaded", r.text
        assert metric(calls, 'source="push",action="load",outcome="ok"') == 1
        assert metric(calls, 'source="push",action="load",outcome="failed"') == 0

        # the engine loses the adapter (a restart, say): the next round loads it back and reads one drift
        auth = engine_auth("ea")
        assert httpx.post(engine.api + "/unload_lora_adapter", json={"lora_name": name}, headers=auth,
                          timeout=30).status_code == 200
        changed, converged = metric(rounds, 'result="changed"'), metric(rounds, 'result="converged"')
        report = (await cp.post("/v1/engines/reconcile", headers=admin())).json()["engines"]
        assert [(e["engine"], e["loaded"]) for e in report] == [("ea", [name])]
        assert metric("loraplane_control_reconcile_drift", 'engine="ea"') == 1
        assert metric(rounds, 'result="changed"') == changed + 1
        assert metric(calls, 'source="reconcile",action="load",outcome="ok"') >= 1

        # held again: the round after changes nothing and the drift is gone
        await cp.post("/v1/engines/reconcile", headers=admin())
        assert metric("loraplane_control_reconcile_drift", 'engine="ea"') == 0
        assert metric(rounds, 'result="converged"') == converged + 1
