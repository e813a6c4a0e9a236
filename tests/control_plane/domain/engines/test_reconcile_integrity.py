"""The reconciler restores only the recorded bytes: they come from the artifact store by digest, so files
edited or removed after registration change nothing: an engine that lost the adapter gets the version
back exactly as it was recorded."""

from __future__ import annotations

import dataclasses
import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.control_plane.conftest import admin, reader
from tests.control_plane.engines import (
    engine_adapters,
    engine_credentials,
    lora_engine,
    served_control_plane,
)
from tests.data_plane.api.conftest import EngineServer
from tests.e2e.test_control_plane_engines import ENGINE_SECRET, engine_auth
from tests.e2e.test_control_plane_engines import _free_port as free_port


@pytest.fixture(scope="module")
def cp_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def engine(demo: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, cp_port: int) -> Iterator[EngineServer]:
    with lora_engine(demo["base"], demo["root"], tmp_path_factory.mktemp("integrity") / "e.log", name="ea",
                     control_plane=f"http://127.0.0.1:{cp_port}") as server:
        yield server


async def test_the_reconciler_restores_the_recorded_bytes_not_the_edited_files(
        settings, engine: EngineServer, demo: dict, cp_port: int) -> None:
    folder = demo["root"] / "edited" / uuid.uuid4().hex[:8]
    shutil.copytree(demo["demo-short"], folder)
    name = f"edited-{folder.name}"
    settings = dataclasses.replace(settings, engine_token_secret=ENGINE_SECRET, engine_credentials=engine_credentials())
    async with served_control_plane(settings, cp_port) as cp:
        body = {"name": "ea", "url": engine.url, "base_model": "demo", "slots_total": 4}
        assert (await cp.post("/v1/engines/register", json=body, headers=admin())).status_code == 200
        r = await cp.post("/v1/load_lora_adapter", headers=admin(),
                          json={"lora_name": name, "lora_path": str(folder), "base_model": "demo"})
        assert r.status_code == 200 and r.json()["engines"][0]["outcome"] == "loaded", r.text
        recorded = r.json()["sha256"]
        # the files change behind the registry's back, and the engine loses the adapter (say, a restart)
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 4096}))
        auth = engine_auth("ea")
        assert httpx.post(engine.api + "/unload_lora_adapter", json={"lora_name": name}, headers=auth,
                          timeout=30).status_code == 200
        report = (await cp.post("/v1/engines/reconcile", headers=admin())).json()["engines"]
        assert [(e["engine"], e["loaded"], e["failed"]) for e in report] == [("ea", [name], [])]
        assert engine_adapters(engine, "ea")[name]["sha256"] == recorded
        [placement] = (await cp.get(f"/v1/lora_adapters/{name}", headers=reader())).json()["placements"]
        assert (placement["observed"], placement["last_error"]) == ("loaded", None)
