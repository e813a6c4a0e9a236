"""`lora_path: hf://org/name[@revision]`: the files are read over HTTP(S) from the Hub's layout
(`$HF_ENDPOINT/org/name/resolve/<revision>/<file>`, as huggingface_hub reads them) by the same object-store
library as the other sources. The Hub cannot be reached here, so a real local HTTP server lays the demo
adapter out the same way and HF_ENDPOINT points at it."""

from __future__ import annotations

import functools
import shutil
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient

from control_plane.artifacts.sources import hub_url
from shared.errors import InvalidRequestError
from tests.control_plane.conftest import admin


@pytest.fixture
def hub(tmp_path: Path, demo: dict[str, Path]) -> Iterator[str]:
    for revision in ("main", "v2"):
        shutil.copytree(demo["demo-poet" if revision == "main" else "demo-short"],
                        tmp_path / "org" / "poet" / "resolve" / revision)
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def test_an_hf_source_is_copied_like_a_folder(client: AsyncTestClient, demo: dict, hub: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub)
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
