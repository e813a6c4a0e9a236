"""The reconciler restores only the recorded bytes: files edited after registration are refused by the
engine (expected_sha256), and the placement is observed failed, not loaded (issue 8, item 1.6)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from litestar.testing import AsyncTestClient

from control_plane.app import create_app
from tests.control_plane.conftest import admin, reader
from tests.control_plane.engines import ENGINE_TOKEN, engine_adapters, lora_engine
from tests.data_plane.api.conftest import EngineServer


@pytest.fixture(scope="module")
def engine(demo: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    with lora_engine(demo["base"], demo["root"], tmp_path_factory.mktemp("integrity") / "e.log") as server:
        yield server


async def test_the_reconciler_does_not_restore_edited_files(settings, engine: EngineServer, demo: dict) -> None:
    folder = demo["root"] / "edited" / uuid.uuid4().hex[:8]
    shutil.copytree(demo["demo-short"], folder)
    name = f"edited-{folder.name}"
    async with AsyncTestClient(app=create_app(dataclasses.replace(settings, engine_token=ENGINE_TOKEN))) as cp:
        body = {"name": "e", "url": engine.url, "base_model": "demo", "slots_total": 4}
        assert (await cp.post("/v1/engines/register", json=body, headers=admin())).status_code == 200
        r = await cp.post("/v1/load_lora_adapter", headers=admin(),
                          json={"lora_name": name, "lora_path": str(folder), "base_model": "demo"})
        assert r.status_code == 200 and r.json()["engines"][0]["outcome"] == "loaded", r.text
        # the files change behind the registry's back, and the engine loses the adapter (say, a restart)
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 4096}))
        auth = {"Authorization": f"Bearer {ENGINE_TOKEN}"}
        assert httpx.post(engine.api + "/unload_lora_adapter", json={"lora_name": name}, headers=auth,
                          timeout=30).status_code == 200
        report = (await cp.post("/v1/engines/reconcile", headers=admin())).json()["engines"]
        assert [(e["engine"], e["failed"]) for e in report] == [("e", [name])]
        assert name not in engine_adapters(engine)
        [placement] = (await cp.get(f"/v1/lora_adapters/{name}", headers=reader())).json()["placements"]
        assert placement["observed"] == "failed" and "sha256" in placement["last_error"]
