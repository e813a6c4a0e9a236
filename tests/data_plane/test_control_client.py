"""The heartbeat the engine sends the control plane, read off a real engine's typed health and stats,
and the registration naming what it serves."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import shutil
from pathlib import Path

import msgspec
import pytest

from data_plane.adapters.loading.peft_loader import load_peft_adapter
from data_plane.control_client import MAX_REASON, ControlPlaneClient
from data_plane.demo.adapters import write_demo_adapters
from data_plane.engine.protocol import EngineHealth
from data_plane.engine.sequence import Request
from data_plane.model.config import ModelConfig
from data_plane.served_model import ServedModel, served_model
from shared.engine_admin import EngineRegistration
from shared.errors import EngineDeadError
from tests.data_plane.api.engines import engine_config, greedy, kill_loop_on_next_step, make_engine


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


def test_the_registration_names_every_name_the_base_model_goes_by(demo_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "checkpoint"
    shutil.copytree(demo_model_dir, model)
    config_json = model / "config.json"
    config_json.write_text(json.dumps({**json.loads(config_json.read_text()), "_name_or_path": "org/demo-base"}))
    config = engine_config(model, enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=5)
    served = served_model(config, "cpu")
    assert served == ServedModel(model_name_or_path="org/demo-base", model_path=str(model.resolve()),
                                 config_digest=hashlib.sha256(config_json.read_bytes()).hexdigest(),
                                 device_kind="cpu", max_lora_rank=16, max_cpu_loras=5,
                                 max_model_len=config.max_model_len)
    # no _name_or_path, LoRA off: only what is known
    plain = served_model(engine_config(demo_model_dir), None)
    assert (plain.model_name_or_path, plain.max_lora_rank, plain.max_cpu_loras) == (None, None, None)
    # the wire body the control plane decodes
    client = ControlPlaneClient("http://127.0.0.1:1", None, name="e1", engine_url="http://127.0.0.1:2",
                                base_model="demo", slots_total=2, served=served, cache_bytes_free=lambda: 1234)
    assert client.heartbeat_body().cache_bytes_free == 1234
    assert client_for(None).heartbeat_body().cache_bytes_free is None
    body = msgspec.json.decode(msgspec.json.encode(EngineRegistration(
        name="e1", url="http://127.0.0.1:2", base_model="demo", **dataclasses.asdict(served))), type=EngineRegistration)
    assert (body.model_path, body.config_digest, body.max_cpu_loras) == (str(model.resolve()), served.config_digest, 5)
    assert body.max_model_len == config.max_model_len is not None  # the context length routers reserve by
