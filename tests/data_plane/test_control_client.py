"""The heartbeat the engine sends the control plane, read off a real engine's typed health and stats."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from data_plane.control_client import MAX_REASON, ControlPlaneClient
from data_plane.engine.protocol import EngineHealth
from data_plane.engine.sequence import Request
from data_plane.lora.demo_adapters import write_demo_adapters
from data_plane.lora.peft_loader import load_peft_adapter
from data_plane.model.config import ModelConfig
from shared.errors import EngineDeadError
from tests.data_plane.api.engines import greedy, kill_loop_on_next_step, make_engine


def client_for(engine: EngineHealth | None) -> ControlPlaneClient:
    return ControlPlaneClient("http://127.0.0.1:1", None, name="e1", engine_url="http://127.0.0.1:2",
                              base_model="demo", slots_total=2, engine=engine)


async def test_heartbeats_report_slots_in_use_and_a_dead_loop(demo_model_dir: Path, tmp_path: Path, monkeypatch):
    engine = make_engine(demo_model_dir, enable_lora=True, max_loras=2, max_lora_rank=16)
    client = client_for(engine)
    engine.start()
    try:
        assert client.heartbeat_body().slots_used == 0 and client.heartbeat_body().healthy
        path = write_demo_adapters(demo_model_dir, tmp_path, names=["demo-poet"])["demo-poet"]
        load = functools.partial(load_peft_adapter, model_config=ModelConfig.from_pretrained(demo_model_dir),
                                 max_rank=16, allowed_roots=[str(tmp_path)])
        await engine.pin_lora(1, load(str(path)))
        body = client.heartbeat_body()
        assert (body.slots_used, body.healthy, body.reason, body.draining) == (1, True, None, False)

        long_reason = "rank 1 is gone " * 100
        kill_loop_on_next_step(engine, monkeypatch, long_reason)
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate(Request("doomed", [1, 2, 3], greedy(2))):
                pass
        body = client.heartbeat_body()
        assert not body.healthy and body.reason == long_reason[:MAX_REASON]
    finally:
        await engine.shutdown()


def test_a_client_without_an_engine_reports_an_idle_healthy_one():
    body = client_for(None).heartbeat_body()
    assert (body.slots_used, body.healthy, body.reason) == (0, True, None)
