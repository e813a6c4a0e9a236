"""What engines report, end to end against the control plane over HTTP: a real engine
registers every name its base model goes by and what it can hold, and its heartbeats the room of its
artifact cache; an engine whose step loop dies, or that starts draining, says so at once rather than
at its next heartbeat, and leaves the listing's healthy engines and the routing table."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from control_plane.db.models import Engine
from control_plane.domain.engines.matching import serves_base_model
from control_plane.settings import ControlPlaneSettings
from data_plane.control_client import ControlPlaneClient
from data_plane.engine.sequence import Request
from shared.errors import EngineDeadError
from tests.control_plane.conftest import reader
from tests.control_plane.engines import CP_TOKENS, engine_credentials, lora_engine, served_control_plane
from tests.data_plane.api.engines import greedy, kill_loop_on_next_step, make_engine
from tests.e2e.test_control_plane_engines import _free_port as free_port

CACHE_BYTES = 1_000_000
SLOW_BEAT_S = 60.0  # far beyond the waits below: only a beat sent at once can be seen in time
WAIT_S = 15.0


@pytest.fixture
def cp_settings(settings: ControlPlaneSettings) -> ControlPlaneSettings:
    return dataclasses.replace(settings, engine_credentials=engine_credentials())


@pytest.fixture
async def cp(cp_settings: ControlPlaneSettings) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    port = free_port()
    async with served_control_plane(cp_settings, port) as client:
        yield client, f"http://127.0.0.1:{port}"


async def listed(client: httpx.AsyncClient, until, what: str) -> dict[str, dict]:  # noqa: ANN001
    """GET /v1/engines (name -> entry) polled until `until(entries)` holds."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while True:
        entries = {e["name"]: e for e in (await client.get("/v1/engines", headers=reader())).json()["data"]}
        if until(entries):
            return entries
        assert asyncio.get_running_loop().time() < deadline, f"{what}: {entries}"
        await asyncio.sleep(0.1)


async def test_a_real_engine_registers_what_it_serves_and_can_hold(
        cp: tuple[httpx.AsyncClient, str], cp_settings: ControlPlaneSettings, demo: dict, tmp_path: Path) -> None:
    client, url = cp
    model = tmp_path / "checkpoint"
    shutil.copytree(demo["base"], model)
    config_json = model / "config.json"
    config_json.write_text(json.dumps({**json.loads(config_json.read_text()), "_name_or_path": "org/demo-base"}))
    digest = hashlib.sha256(config_json.read_bytes()).hexdigest()
    with lora_engine(model, demo["root"], tmp_path / "ea.log", "--max-loras", "2", "--max-lora-rank", "16",
                     "--max-cpu-loras", "5", "--lora-cache-dir", str(tmp_path / "cache"),
                     "--lora-cache-max-bytes", str(CACHE_BYTES), name="ea", control_plane=url):
        entries = await listed(client, lambda e: "ea" in e and e["ea"]["cache_bytes_free"] is not None,
                               "the engine registered and heartbeat")
    ea = entries["ea"]
    assert {k: ea[k] for k in ("base_model", "model_name_or_path", "model_path", "config_digest", "device_kind",
                               "slots_total", "max_lora_rank", "max_cpu_loras", "cache_bytes_free")} == {
        "base_model": "demo", "model_name_or_path": "org/demo-base", "model_path": str(model.resolve()),
        "config_digest": digest, "device_kind": "cpu", "slots_total": 2, "max_lora_rank": 16, "max_cpu_loras": 5,
        "cache_bytes_free": CACHE_BYTES}
    # an adapter naming its base model by any of these finds the engine
    db = create_async_engine(cp_settings.database_url)
    try:
        async with async_sessionmaker(db)() as s:
            for base in ("demo", "org/demo-base", f"{model.resolve()}/", digest, "org/other"):
                found = (await s.scalars(select(Engine.name).where(serves_base_model(base)))).all()
                assert found == ([] if base == "org/other" else ["ea"]), base
    finally:
        await db.dispose()


async def test_a_dead_step_loop_and_a_drain_are_reported_at_once(
        cp: tuple[httpx.AsyncClient, str], demo: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    client, url = cp
    engine = make_engine(demo["base"], enable_lora=True)
    engine.start()
    dying = ControlPlaneClient(url, CP_TOKENS["ea"], name="ea", engine_url="http://127.0.0.1:1", base_model="demo",
                               slots_total=4, engine=engine, heartbeat_s=SLOW_BEAT_S)
    leaving = ControlPlaneClient(url, CP_TOKENS["eb"], name="eb", engine_url="http://127.0.0.1:2", base_model="demo",
                                 slots_total=4, heartbeat_s=SLOW_BEAT_S)
    await dying.start()
    await leaving.start()
    try:
        await listed(client, lambda e: {n: x["state"] for n, x in e.items()} == {"ea": "healthy", "eb": "healthy"},
                     "both registered")
        kill_loop_on_next_step(engine, monkeypatch, "rank 1 is gone")
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate(Request("doomed", [1, 2, 3], greedy(2))):
                pass
        await listed(client, lambda e: e["ea"]["state"] == "unhealthy", "the dead engine is unhealthy")
        leaving.draining = True  # as drain() sets it; the heartbeat (not the drain call) must say so
        entries = await listed(client, lambda e: e["eb"]["state"] == "draining", "the engine drains")
        assert entries["ea"]["state"] == "unhealthy"
        routes = (await client.get("/v1/routes", headers=reader())).json()
        assert routes["engines"] == [] and routes["models"] == []  # neither routes requests any more
    finally:
        await dying.stop()
        await leaving.stop()
        await engine.shutdown()
