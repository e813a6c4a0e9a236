"""Schemathesis against a real engine: its OpenAPI document is the contract, checked with every
phase (examples, coverage, fuzzing, stateful) and every check: no 5xx, no body or status that its
schema does not document, schema-valid requests accepted (semantic 400s are listed in engine.toml).

The engine runs the demo model at --max-model-len 64 with LoRA on, one demo adapter preloaded and an
admin token, on a free loopback port.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model
from tests.contracts.schemathesis_run import run_schemathesis
from tests.data_plane.api.conftest import SERVED_NAME, run_engine

pytest.importorskip("schemathesis")

CONFIG = Path(__file__).with_name("engine.toml")
ADAPTER = "demo-pirate"
MAX_TIME_S = 40  # schemathesis' own budget; with the engine's start the test stays within ~60 s


def test_the_engine_honours_its_openapi_contract(tmp_path, monkeypatch):
    model = tmp_path / "model"
    write_demo_model(model, seed=0)
    adapter = write_demo_adapters(model, tmp_path / "adapters", names=[ADAPTER])[ADAPTER]
    token = secrets.token_urlsafe(16)
    monkeypatch.setenv("LORAPLANE_ADMIN_TOKEN", token)
    flags = ["--max-model-len", "64", "--enable-lora", "--lora-modules", f"{ADAPTER}={adapter}"]
    with run_engine(model, tmp_path / "engine.log", *flags) as engine:
        env = {
            **os.environ,
            "CONTRACT_ADMIN_TOKEN": token,  # for the hooks module, tests.contracts.hooks
            "CONTRACT_MODELS": f"{SERVED_NAME},{ADAPTER}",
            "CONTRACT_ADAPTER_PATH": str(adapter),
        }
        result = run_schemathesis(engine.url, CONFIG, env, MAX_TIME_S)
        assert engine.process.poll() is None, engine.log_tail()
    output = result.stdout + result.stderr
    # non-zero on any failure or error; warnings (e.g. most random adapter paths lying outside
    # --lora-roots) are reported in the output but are not contract violations
    assert result.returncode == 0, output[-20000:]
