"""`lora_path: hf://org/name[@revision]`: the files are read over HTTP(S) from the Hub's layout
(`$HF_ENDPOINT/org/name/resolve/<revision>/<file>`, as huggingface_hub reads them) by the same object-store
library as the other sources. The Hub cannot be reached here, so a real local HTTP server lays the demo
adapter out the same way and HF_ENDPOINT points at it."""

from __future__ import annotations

import pytest
from litestar.testing import AsyncTestClient

from control_plane.artifacts.sources import hub_url
from shared.errors import InvalidRequestError
from tests.control_plane.artifacts.conftest import Hub
from tests.control_plane.conftest import admin


async def test_an_hf_source_is_copied_like_a_folder(client: AsyncTestClient, demo: dict, hub: Hub) -> None:
    folder = await client.post("/v1/load_lora_adapter", headers=admin(), json={
        "lora_name": "from-folder", "lora_path": str(demo["demo-poet"]), "base_model": "demo"})
    r = await client.post("/v1/load_lora_adapter", headers=admin(), json={
        "lora_name": "from-hub", "lora_path": "hf://org/poet", "base_model": "demo"})
    assert r.status_code == 200, r.text
    assert r.json()["sha256"] == folder.json()["sha256"]  # the same bytes, whichever way they came
    pinned = await client.post("/v1/load_lora_adapter", headers=admin(), json={
        "lora_name": "from-hub", "lora_path": "hf://org/poet@v2", "base_model": "demo"})
    assert pinned.status_code == 200 and pinned.json()["version"] == 2, pinned.text
    missing = await client.post("/v1/load_lora_adapter", headers=admin(), json={
        "lora_name": "nothing", "lora_path": "hf://org/nothing", "base_model": "demo"})
    assert missing.status_code == 400 and "adapter_config.json is missing" in missing.json()["error"]["message"]


def test_hub_paths_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    assert hub_url("hf://org/name@v1.0") == "https://huggingface.co/org/name/resolve/v1.0/"
    for bad in ("hf://name", "hf://a/b/c", "hf://org/../x", "hf://org/x@a/b"):
        with pytest.raises(InvalidRequestError):
            hub_url(bad)
