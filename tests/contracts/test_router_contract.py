"""Schemathesis against a real router: its OpenAPI document is the contract, checked with every phase
(examples, coverage, fuzzing, stateful) and every check: no 5xx, no body or status that its schema does
not document, schema-valid requests accepted (semantic 400s of the engine behind it are listed in
router.toml).

`loraplane router` runs with a client key, in front of `loraplane control` (SQLite) and one
`loraplane engine` (the demo model at --max-model-len 64, LoRA on) registered with it, which holds one
demo adapter: the router's requests are routed and answered by a real engine, every credential in the
environment.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import httpx
import pytest

from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model
from tests.contracts.schemathesis_run import run_schemathesis
from tests.data_plane.api.conftest import SHARED_FLAGS, run_engine
from tests.e2e.test_control_plane_engines import (
    ADMIN,
    CP_TOKENS,
    _free_port,
    control_plane,
    engine_token,
    started,
)

pytest.importorskip("schemathesis")

CONFIG = Path(__file__).with_name("router.toml")
BASE_MODEL, ADAPTER = "demo", "demo-pirate"
ROUTER_TOKEN, ENGINE_KEY, CLIENT_KEY = "contract-router-token", "contract-engine-key", "contract-client-key"
MAX_TIME_S = 35  # schemathesis' own budget; with the three processes' start the test stays within ~70 s


def test_the_router_honours_its_openapi_contract(tmp_path: Path) -> None:
    base = tmp_path / "models" / BASE_MODEL
    write_demo_model(base, seed=0)
    root = tmp_path / "adapters"
    adapters = write_demo_adapters(base, root, names=[ADAPTER])
    key = {"Authorization": f"Bearer {CLIENT_KEY}"}
    with contextlib.ExitStack() as stack:
        cp = stack.enter_context(control_plane(tmp_path, root, LORAPLANE_ROUTER_TOKENS=ROUTER_TOKEN))
        stack.enter_context(run_engine(
            base, tmp_path / "engine.log", "--max-model-len", "64", "--enable-lora", "--lora-roots", str(root),
            "--admin-token", engine_token("e1"), "--control-plane", cp, "--engine-name", "e1", *SHARED_FLAGS,
            env={"LORAPLANE_CONTROL_PLANE_TOKEN": CP_TOKENS["e1"], "LORAPLANE_API_KEY": ENGINE_KEY}))
        loaded = httpx.post(cp + "/v1/load_lora_adapter", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120,
                            json={"lora_name": ADAPTER, "lora_path": str(adapters[ADAPTER]), "base_model": BASE_MODEL})
        assert loaded.status_code == 200, loaded.text
        router = f"http://127.0.0.1:{_free_port()}"
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")}, "PYTHONUNBUFFERED": "1",
               "LORAPLANE_ROUTER_TOKEN": ROUTER_TOKEN, "LORAPLANE_ENGINE_API_KEY": ENGINE_KEY,
               "LORAPLANE_API_KEYS": CLIENT_KEY}
        process = stack.enter_context(started(
            [sys.executable, "-m", "shared.cli", "router", "--control-plane", cp, "--port", router.rsplit(":", 1)[1]],
            tmp_path / "router.log", env,
            lambda: {BASE_MODEL, ADAPTER} <= {m["id"] for m in httpx.get(
                router + "/v1/models", headers=key, timeout=2).json()["data"]}, "router"))
        env = {
            **os.environ,
            "CONTRACT_CLIENT_KEY": CLIENT_KEY,  # for router.toml's headers
            "CONTRACT_MODELS": f"{BASE_MODEL},{ADAPTER}",  # for the hooks module, tests.contracts.hooks
        }
        result = run_schemathesis(router, CONFIG, env, MAX_TIME_S)
        assert process.poll() is None, (tmp_path / "router.log").read_text()[-3000:]
    output = result.stdout + result.stderr
    # non-zero on any failure or error; warnings are reported in the output but are not contract violations
    assert result.returncode == 0, output[-20000:]
