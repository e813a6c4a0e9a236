"""A fetched adapter's weights are parsed and checked while they arrive (StagedTensors, fed by the download's
hashing thread): what that made is used only once the file's sha256 matched, and dropped otherwise.
Over a real loopback artifact server and the real cache and PEFT loader; the oracle is the same adapter
loaded from its folder on disk (which test_peft_loader checks against peft itself)."""

from __future__ import annotations

import gc
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

from data_plane.lora.artifact_cache import PARTIAL_DIR, ArtifactCache
from data_plane.lora.artifact_fetch import ArtifactFetcher, ArtifactOrigins
from data_plane.lora.errors import LoRAAdapterError
from data_plane.lora.peft_loader import load_peft_adapter
from data_plane.lora.safetensors_memory import StagedTensors
from data_plane.lora.weights import LoRAAdapterWeights
from data_plane.model.config import ModelConfig
from shared.peft import CONFIG_NAME, WEIGHTS_NAME
from tests.data_plane.lora.artifact_server import ArtifactServer, serve_artifacts

MiB = 1 << 20


@pytest.fixture
def cp() -> Iterator[ArtifactServer]:
    with serve_artifacts() as server:
        yield server


@pytest.fixture
async def cache(cp: ArtifactServer, tmp_path: Path) -> AsyncIterator[ArtifactCache]:
    fetcher = ArtifactFetcher(ArtifactOrigins(cp.url), "t", max_bytes=256 * MiB, read_timeout_s=5)
    opened = ArtifactCache(tmp_path / "cache", 256 * MiB, fetcher)
    opened.open()
    yield opened
    await opened.settle()
    opened.close()
    await fetcher.aclose()


@pytest.fixture
def adapter(peft_adapters, tmp_path: Path) -> Path:
    """A PEFT adapter's two files (peft's README left out: a version is exactly these)."""
    folder = tmp_path / "adapter"
    folder.mkdir()
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        shutil.copy(peft_adapters("llama", "attention") / name, folder / name)
    return folder


def load(folder: Path, base: Path, cache: ArtifactCache | None, root: Path) -> LoRAAdapterWeights:
    return load_peft_adapter(folder, ModelConfig.from_pretrained(base), max_rank=64, allowed_roots=[str(root)],
                             verified=cache.verified if cache is not None else None)


def staged_alive(at_most: int = -1) -> int:
    """How many StagedTensors exist; with `at_most`, waits (up to 10 s) for the download's worker thread to
    let go of its arguments once it has raised (it drops them right after the error reached the caller)."""
    deadline = time.monotonic() + 10
    while True:
        gc.collect()
        alive = sum(1 for o in gc.get_objects() if type(o) is StagedTensors)
        if alive <= at_most or at_most < 0 or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


async def test_a_fetched_version_is_loaded_from_what_was_staged_and_equals_the_files(
        cp, cache, tiny_checkpoints, adapter):
    base = tiny_checkpoints["llama"]
    ref = cp.publish_folder(adapter)
    async with cache.acquire(ref) as folder:
        held = cache.verified.contents_of(folder / WEIGHTS_NAME)
        assert held is not None and held.tensors is not None  # parsed and checked while it arrived
        staged = {held.tensors.get_tensor(k).untyped_storage().data_ptr() for k in held.tensors.keys()}  # noqa: SIM118
        ours = load(folder, base, cache, cache.root)
    # the host copy is what the staging made while the bytes arrived (no copy of it after the last byte)
    assert {w.a_t.untyped_storage().data_ptr() for m in ours.layers.values() for w in m.values()} <= staged
    assert {w.b_t.untyped_storage().data_ptr() for m in ours.layers.values() for w in m.values()} <= staged
    expected = load(adapter, base, None, adapter.parent)
    assert ours.sha256 == expected.sha256 == ref.digest
    assert ours.layers.keys() == expected.layers.keys()
    for layer, modules in expected.layers.items():
        for short, w in modules.items():
            assert torch.equal(ours.layers[layer][short].lora_a, w.lora_a), (layer, short)
            assert torch.equal(ours.layers[layer][short].lora_b, w.lora_b), (layer, short)
            assert ours.layers[layer][short].scaling == w.scaling


def _flip_last_data_byte(adapter: Path) -> bytes:
    data = bytearray((adapter / WEIGHTS_NAME).read_bytes())
    data[-1] ^= 0x01  # the last tensor's last byte: the header and every other tensor still parse and check
    return bytes(data)


@pytest.mark.parametrize("nan", [False, True], ids=["flipped", "nan"])
async def test_a_byte_corrupted_late_is_refused_and_nothing_staged_is_kept(
        cp, cache, tiny_checkpoints, adapter, nan):
    ref = cp.publish_folder(adapter)
    corrupt = _flip_last_data_byte(adapter)
    if nan:  # bytes whose staging itself finds a NaN: still the checksum is what refuses them
        corrupt = corrupt[:-4] + torch.tensor([float("nan")]).numpy().tobytes()
    cp.corrupt[WEIGHTS_NAME] = corrupt
    before = staged_alive()
    with pytest.raises(LoRAAdapterError, match=f"checksum mismatch for {WEIGHTS_NAME}"):
        async with cache.acquire(ref):
            pytest.fail("a corrupted version was handed out")
    folder = cache.root / ref.digest
    assert all(cache.verified.contents_of(folder / n) is None for n in (CONFIG_NAME, WEIGHTS_NAME))
    assert ref.digest not in cache and not folder.exists() and list((cache.root / PARTIAL_DIR).iterdir()) == []
    assert staged_alive(at_most=before) == before  # what was staged from the bad bytes is gone with them
    # the same version served right afterwards is fetched again, whole, and loads
    del cp.corrupt[WEIGHTS_NAME]
    async with cache.acquire(ref) as folder:
        assert load(folder, tiny_checkpoints["llama"], cache, cache.root).sha256 == ref.digest


async def test_weights_the_staging_cannot_parse_are_refused_by_the_loader_as_a_file_is(cp, cache, tiny_checkpoints,
                                                                                      tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / CONFIG_NAME).write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}')
    (folder / WEIGHTS_NAME).write_bytes((2 * MiB).to_bytes(8, "little") + b"{" * (3 * MiB))  # not JSON
    ref = cp.publish_folder(folder)
    async with cache.acquire(ref) as cached:
        held = cache.verified.contents_of(cached / WEIGHTS_NAME)
        assert held is not None and held.tensors is None  # verified, but nothing staged: parsed by the loader
        with pytest.raises(LoRAAdapterError, match="corrupt or truncated"):
            load(cached, tiny_checkpoints["llama"], cache, cache.root)
    with pytest.raises(LoRAAdapterError, match="corrupt or truncated"):
        load(folder, tiny_checkpoints["llama"], None, tmp_path)
