"""`pip install loraplane` (the base install, no extra) into a fresh virtualenv: no torch there, and the
control plane still runs — `loraplane control --help`, then a real `loraplane control` on SQLite that
validates a PEFT folder (the safetensors header read without torch) and records it. `loraplane engine`
says to install loraplane[engine] instead of failing on an import.

The package is built from the Docker build context (the repository less .dockerignore), so this also shows
that what deploy/control-plane.Dockerfile copies is enough. The adapter is written beforehand by this
(test) interpreter, which has torch. Needs a package registry: without one the test skips, unless the
environment variable CI is set, where that is a failure. Marked `packaging`; takes a minute or two.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model
from tests.deploy.context import context_files
from tests.e2e.test_control_plane_engines import ADMIN, READ, control_plane

pytestmark = [pytest.mark.packaging, pytest.mark.timeout(900)]

REPO_ROOT = Path(__file__).resolve().parents[2]
# what only the engine extra brings, and our engine package: none may load with the control plane
ENGINE_ONLY = {"torch", "numpy", "safetensors", "tokenizers", "llguidance", "xxhash", "data_plane"}


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: a missing registry is a failure there)")
    pytest.skip(reason)


def _clean_env() -> dict[str, str]:
    """The caller's environment without our variables and without a path into this checkout."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("LORAPLANE_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with `pip install <build context>` and nothing else; its bin/ directory."""
    tmp = tmp_path_factory.mktemp("base-install")
    probe = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "litestar"],
                           capture_output=True, text=True, timeout=120, env=_clean_env())
    if probe.returncode != 0:
        _unavailable(f"no package registry reachable: {probe.stderr.strip()[-300:]}")
    source = tmp / "src"
    for rel in context_files(REPO_ROOT):
        (source / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / rel, source / rel)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(source)],
                             capture_output=True, text=True, timeout=600, cwd=tmp, env=_clean_env())
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-4000:]
    return venv / "bin"


def run(bin_dir: Path, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(bin_dir / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=timeout,
                          cwd=bin_dir.parent.parent, env=_clean_env())


def test_the_base_install_has_no_torch_and_the_control_plane_imports_nothing_of_the_engine(base_venv: Path) -> None:
    r = run(base_venv, "python", "-c", "import torch")
    assert r.returncode != 0 and "No module named 'torch'" in r.stderr, r.stderr
    script = ("import json, sys, control_plane.app, control_plane.cli, control_plane.db.migrate, shared.cli, "
              "control_plane.admin_cli.adapters, control_plane.admin_cli.engines, control_plane.admin_cli.stats, "
              "control_plane.admin_cli.audit; "
              "print(json.dumps([control_plane.app.__file__, sorted({m.split('.')[0] for m in sys.modules})]))")
    r = run(base_venv, "python", "-c", script)
    assert r.returncode == 0, r.stderr
    where, loaded = json.loads(r.stdout)
    assert where.startswith(str(base_venv.parent)), where  # the installed copy, not this checkout
    assert ENGINE_ONLY.isdisjoint(loaded), sorted(ENGINE_ONLY & set(loaded))


def test_the_cli_serves_control_and_names_the_extra_for_the_engine(base_venv: Path) -> None:
    r = run(base_venv, "loraplane", "control", "--help")
    assert r.returncode == 0 and "--lora-roots" in r.stdout, r.stdout + r.stderr
    r = run(base_venv, "loraplane", "adapters", "pin", "--help")  # the admin CLI (click, rich) is there too
    assert r.returncode == 0 and "LORAPLANE_TOKEN" in r.stdout, r.stdout + r.stderr
    for command in (["engine", "--help"], ["engine", "/models/x"], ["up"]):
        r = run(base_venv, "loraplane", *command)
        assert r.returncode == 1 and "install loraplane[engine]" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr, r.stderr


def test_the_control_plane_records_a_peft_folder_without_torch(base_venv: Path, tmp_path: Path) -> None:
    base = tmp_path / "models" / "demo"
    write_demo_model(base, seed=0)  # here, with torch: the base venv has none
    adapters = write_demo_adapters(base, tmp_path / "adapters")
    folder = adapters["demo-poet"]
    config = json.loads((folder / "adapter_config.json").read_text())
    with control_plane(tmp_path, tmp_path / "adapters", launcher=[str(base_venv / "loraplane")]) as cp:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        r = httpx.post(cp + "/v1/load_lora_adapter", headers=admin, timeout=60,
                       json={"lora_name": "poet", "lora_path": str(folder), "base_model": "demo"})
        assert r.status_code == 200, r.text
        body = r.json()
        # no engine is registered: the version is recorded, placed nowhere
        assert (body["name"], body["version"], body["created"], body["engines"]) == ("poet", 1, True, [])
        assert (body["rank"], body["alpha"]) == (config["r"], config["lora_alpha"])
        outside = httpx.post(cp + "/v1/load_lora_adapter", headers=admin, timeout=60,
                             json={"lora_name": "x", "lora_path": str(base), "base_model": "demo"})
        assert outside.status_code == 400, outside.text  # the base model's folder: not under --lora-roots
        listed = httpx.get(cp + "/v1/lora_adapters", headers={"Authorization": f"Bearer {READ}"}, timeout=30)
        assert listed.status_code == 200, listed.text
        assert [(a["name"], a["active_version"]) for a in listed.json()["data"]] == [("poet", 1)]


def test_the_router_runs_in_the_base_install(base_venv: Path) -> None:
    """`loraplane router` is in the base install: its app imports no torch and nothing of the engine."""
    r = run(base_venv, "loraplane", "router", "--help")
    assert r.returncode == 0 and "--control-plane" in r.stdout, r.stdout + r.stderr
    script = ("import json, sys, data_plane.router.app, data_plane.router.cli; "
              "print(json.dumps(sorted(sys.modules)))")
    r = run(base_venv, "python", "-c", script)
    assert r.returncode == 0, r.stderr
    loaded = set(json.loads(r.stdout))
    engine_parts = {m for m in loaded if m.startswith("data_plane.") and not m.startswith("data_plane.router")}
    assert engine_parts == set(), sorted(engine_parts)
    assert (ENGINE_ONLY - {"data_plane"}).isdisjoint({m.split(".")[0] for m in loaded})


def test_the_artifact_side_imports_in_the_base_install(base_venv: Path) -> None:
    """data_plane.adapters.artifacts (fetch, verify, cache adapter versions by digest) needs no engine extra:
    a torch-free process beside a vLLM server can use it."""
    script = ("import json, sys, data_plane.adapters.artifacts.cache, data_plane.adapters.artifacts.fetch, "
              "data_plane.adapters.artifacts.metrics; print(json.dumps(sorted(sys.modules)))")
    r = run(base_venv, "python", "-c", script)
    assert r.returncode == 0, r.stderr
    loaded = set(json.loads(r.stdout))
    assert (ENGINE_ONLY - {"data_plane"}).isdisjoint({m.split(".")[0] for m in loaded})
