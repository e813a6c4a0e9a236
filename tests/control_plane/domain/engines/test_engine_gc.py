"""Engines silent past --engine-gc-after-s are removed by a real `loraplane control` process: the engine and
its placements go, as `loraplane engines remove` does, with one audit event by `system:engine-gc` naming
the reason and the last heartbeat; an engine that keeps heartbeating stays. A setting under the stale
window is refused at start."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

import httpx

from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model
from tests.control_plane.domain.adapters.helpers import UNREACHABLE
from tests.data_plane.api.conftest import REPO_ROOT
from tests.e2e.test_control_plane_engines import ADMIN, _free_port, control_plane, wait_for


def test_engines_silent_past_the_gc_setting_are_removed_with_their_placements(tmp_path: Path) -> None:
    base = tmp_path / "models" / "demo"
    write_demo_model(base, seed=0)
    root = tmp_path / "adapters"
    poet = write_demo_adapters(base, root, names=["demo-poet"])["demo-poet"]
    with control_plane(tmp_path, root, flags=("--engine-gc-after-s", "3"), LORAPLANE_ENGINE_STALE_AFTER_S="1") as cp:
        admin = httpx.Client(base_url=cp, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
        registered = {}
        for name in ("gone", "kept"):
            r = admin.post("/v1/engines/register",
                           json={"name": name, "url": UNREACHABLE, "base_model": "demo", "slots_total": 4})
            assert r.status_code == 200, r.text
            registered[name] = r.json()
        r = admin.post("/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": str(poet),
                                                           "base_model": "demo", "engines": ["gone", "kept"]})
        assert r.status_code in (200, 207, 502), r.text  # neither engine answers: the placements stay recorded
        placed = {p["engine"] for p in admin.get("/v1/lora_adapters/poet").json()["placements"]}
        assert placed == {"gone", "kept"}

        def collected() -> bool:
            assert admin.post("/v1/engines/kept/heartbeat", json={}).status_code == 200  # "kept" stays alive
            return [e["name"] for e in admin.get("/v1/engines").json()["data"]] == ["kept"]

        wait_for(collected, "the silent engine to be collected")
        placed = {p["engine"] for p in admin.get("/v1/lora_adapters/poet").json()["placements"]}
        assert placed == {"kept"}
        events = admin.get("/v1/audit", params={"action": "delete_engine"}).json()["data"]
        assert [(e["actor"], e["target"], e["outcome"]) for e in events] == [("system:engine-gc", "gone", "ok")]
        detail = events[0]["detail"]
        assert "no heartbeat for more than 3 s" in detail["reason"]
        assert detail["engine_gc_after_s"] == 3
        assert _same_instant(detail["last_heartbeat"], registered["gone"]["last_heartbeat"])
        # it may come back: registering again is accepted (as after `engines remove`)
        again = admin.post("/v1/engines/register",
                           json={"name": "gone", "url": UNREACHABLE, "base_model": "demo", "slots_total": 4})
        assert again.status_code == 200, again.text


def test_a_gc_setting_under_the_stale_window_is_refused_at_start(tmp_path: Path) -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")},
           "LORAPLANE_ENGINE_STALE_AFTER_S": "30", "LORAPLANE_ENGINE_GC_AFTER_S": "10",
           "LORAPLANE_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'cp.db'}"}
    done = subprocess.run([sys.executable, "-m", "shared.cli", "control", "--port", str(_free_port())], capture_output=True,
                          text=True, timeout=60, cwd=REPO_ROOT, env=env)
    assert done.returncode != 0
    assert "engine_gc_after_s must be 0 (off) or at least engine_stale_after_s" in done.stderr


def _same_instant(a: str, b: str) -> bool:
    return dt.datetime.fromisoformat(a) == dt.datetime.fromisoformat(b.replace("Z", "+00:00"))
