"""The artifact side runs in a process without torch (a torch-free sidecar reuses it): importing every
module of data_plane.adapters.artifacts, and running work on its background threads, loads neither torch
nor the engine's config, engine, LoRA compute or model."""

from __future__ import annotations

import json
import subprocess
import sys

ENGINE_SIDE = ("torch", "safetensors", "numpy", "data_plane.config", "data_plane.engine", "data_plane.lora",
               "data_plane.model", "data_plane.adapters.loading")

SCRIPT = """
import asyncio, importlib, json, pkgutil, sys
import data_plane.adapters.artifacts as artifacts
names = [m.name for m in pkgutil.walk_packages(artifacts.__path__, artifacts.__name__ + ".")]
for name in names:
    importlib.import_module(name)
from data_plane.background import fetch_off_loop, read_off_loop
async def run():
    return await fetch_off_loop(sum, [1, 2]), await read_off_loop(sum, [3, 4])
assert asyncio.run(run()) == (3, 7)
print(json.dumps({"modules": names, "loaded": sorted(sys.modules)}))
"""


def test_the_artifact_side_imports_and_runs_without_torch_or_the_engine():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert {"data_plane.adapters.artifacts.cache", "data_plane.adapters.artifacts.fetch"} <= set(out["modules"])
    loaded = [m for m in out["loaded"] if any(m == e or m.startswith(e + ".") for e in ENGINE_SIDE)]
    assert loaded == []
