"""Schemathesis against a real control plane: its OpenAPI document is the contract, checked with every
phase (examples, coverage, fuzzing, stateful) and every check: no 5xx, no body or status that its
schema does not document, schema-valid requests accepted (semantic 400s are listed in control_plane.toml).

`loraplane control` runs on SQLite with an admin token from the environment and the demo adapters
under its adapter root; one engine is registered at a loopback address nothing listens on, so loads
and activations push and answer 502 (all engines failed) with their documented body.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model
from tests.contracts.schemathesis_run import run_schemathesis
from tests.control_plane.domain.adapters.helpers import UNREACHABLE
from tests.e2e.test_control_plane_engines import ADMIN, control_plane

pytest.importorskip("schemathesis")

CONFIG = Path(__file__).with_name("control_plane.toml")
BASE_MODEL = "demo"
MAX_TIME_S = 30  # schemathesis' own budget; with the control plane's start the test stays within ~45 s


def test_the_control_plane_honours_its_openapi_contract(tmp_path: Path) -> None:
    base = tmp_path / "models" / BASE_MODEL
    write_demo_model(base, seed=0)
    root = tmp_path / "adapters"
    adapters = write_demo_adapters(base, root)
    with control_plane(tmp_path, root) as url:
        engine = {"name": "absent-engine", "url": UNREACHABLE, "base_model": BASE_MODEL, "slots_total": 4}
        registered = httpx.post(f"{url}/v1/engines/register", json=engine, timeout=30,
                                headers={"Authorization": f"Bearer {ADMIN}"})
        assert registered.status_code == 200, registered.text
        env = {
            **os.environ,
            "CONTRACT_ADMIN_TOKEN": ADMIN,
            "CONTRACT_ADAPTER_PATHS": os.pathsep.join(str(p) for p in adapters.values()),
            "CONTRACT_BASE_MODEL": BASE_MODEL,
        }
        result = run_schemathesis(url, CONFIG, env, MAX_TIME_S)
    output = result.stdout + result.stderr
    # non-zero on any failure or error; warnings (e.g. operations that mostly answer 404 for random
    # names) are reported in the output but are not contract violations
    assert result.returncode == 0, output[-20000:]
