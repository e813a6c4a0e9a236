"""TensorStage: a fetched weights file copied into the host layout while it arrives is used only once every
byte matched its sha256 (else nothing of it is left), is given up while the engine is busy, and is what
the loader adopts (tests/data_plane/adapters/loading/test_peft_loader.py's held-bytes tests run
staged too: the same tensors and refusals as from the files)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from data_plane.adapters.artifacts.fetch import ArtifactFetcher, ArtifactOrigins
from data_plane.adapters.artifacts.verified_files import VerifiedFiles
from data_plane.adapters.loading.peft_loader import load_peft_adapter
from data_plane.adapters.loading.staging import TensorStage
from data_plane.background import BackgroundPace
from data_plane.lora.errors import LoRAAdapterError
from data_plane.model.config import ModelConfig
from tests.data_plane.adapters.artifacts.artifact_server import ArtifactServer, serve_artifacts
from tests.data_plane.adapters.loading.shared_files import own_shared_files

TOKEN = "engine-token-1"
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture
def cp() -> Iterator[ArtifactServer]:
    with serve_artifacts() as server:
        yield server


def files_of(adapter: Path) -> dict[str, bytes]:
    return {name: (adapter / name).read_bytes() for name in ("adapter_config.json", WEIGHTS)}


async def test_a_fetched_adapter_is_loaded_from_what_was_staged_as_it_arrived(cp, tiny_checkpoints, peft_adapters,
                                                                              tmp_path):
    base, adapter = tiny_checkpoints["llama"], peft_adapters("llama", "patterns")
    ref = cp.publish(files_of(adapter))
    fetcher = ArtifactFetcher(ArtifactOrigins(cp.url), TOKEN, max_bytes=1 << 30, read_timeout_s=5, stage=TensorStage)
    before = own_shared_files()
    try:
        received = await fetcher.receive(await fetcher.manifest(ref))
    finally:
        await fetcher.aclose()
    staged = own_shared_files() - before
    assert received[WEIGHTS].stage is not None and len(staged) == 1  # the host copy exists before any load
    verified, folder = VerifiedFiles(), tmp_path / ref.digest
    for name, r in received.items():
        verified.hold(folder / name, hashlib.sha256(r.data).hexdigest(), r.data, r.stage)
    config = ModelConfig.from_pretrained(base)
    ours = load_peft_adapter(folder, config, max_rank=64, allowed_roots=[str(tmp_path)], verified=verified)
    from_disk = load_peft_adapter(adapter, config, max_rank=64, allowed_roots=[str(adapter.parent)])
    assert ours.shared is not None and {Path(ours.shared.file)} == staged  # adopted: nothing copied again
    assert ours.description == from_disk.description
    for index, modules in from_disk.layers.items():
        for name, m in modules.items():
            assert ours.layers[index][name].a_t.equal(m.a_t) and ours.layers[index][name].b_t.equal(m.b_t)
    # a second load of the same held bytes (another name, same digest) copies them itself
    again = load_peft_adapter(folder, config, max_rank=64, allowed_roots=[str(tmp_path)], verified=verified)
    assert again.shared is not None and again.shared.file != ours.shared.file
    verified.release_under(folder)
    assert from_disk.shared is not None  # each load's host copy, and nothing else
    assert own_shared_files() - before == {Path(w.shared.file) for w in (ours, again, from_disk) if w.shared}


@pytest.mark.parametrize("where", ["first", "last"])
async def test_a_flipped_byte_refuses_the_load_and_leaves_nothing_staged(where, cp, peft_adapters):
    files = files_of(peft_adapters("llama", "patterns"))
    ref = cp.publish(files)
    served = bytearray(files[WEIGHTS])
    at = 8 + 100 if where == "first" else len(served) - 1  # in the header, or in the last tensor
    served[at] ^= 0x01
    cp.corrupt[WEIGHTS] = bytes(served)
    fetcher = ArtifactFetcher(ArtifactOrigins(cp.url), TOKEN, max_bytes=1 << 30, read_timeout_s=5, stage=TensorStage)
    before = own_shared_files()
    try:
        with pytest.raises(LoRAAdapterError, match=f"^checksum mismatch for {WEIGHTS}"):
            await fetcher.receive(await fetcher.manifest(ref))
    finally:
        await fetcher.aclose()
    # the stage's copy of the unverified bytes is gone (files of earlier tests may go meanwhile: their
    # holders' finalizers run when the collector gets to them)
    deadline = time.monotonic() + 5
    while own_shared_files() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not own_shared_files() - before


def test_a_stage_that_finds_the_engine_busy_gives_up_and_the_loader_copies(peft_adapters, tiny_checkpoints,
                                                                            tmp_path):
    """With requests in flight the stage would only add work beside the download: it copies nothing,
    leaves no file, and the load copies the verified bytes itself (the same tensors)."""
    base, adapter = tiny_checkpoints["llama"], peft_adapters("llama", "patterns")
    data = bytearray((adapter / WEIGHTS).read_bytes())
    before = own_shared_files()
    stage = TensorStage(data, BackgroundPace(lambda: True))
    stage.arrived(len(data))
    stage.finish()
    assert own_shared_files() == before
    verified, folder = VerifiedFiles(), tmp_path / "fetched"
    verified.hold(folder / "adapter_config.json", "0" * 64, bytearray((adapter / "adapter_config.json").read_bytes()))
    verified.hold(folder / WEIGHTS, hashlib.sha256(data).hexdigest(), data, stage)
    config = ModelConfig.from_pretrained(base)
    ours = load_peft_adapter(folder, config, max_rank=64, allowed_roots=[str(tmp_path)], verified=verified)
    from_disk = load_peft_adapter(adapter, config, max_rank=64, allowed_roots=[str(adapter.parent)])
    for index, modules in from_disk.layers.items():
        for name, m in modules.items():
            assert ours.layers[index][name].a_t.equal(m.a_t) and ours.layers[index][name].b_t.equal(m.b_t)
    assert ours.shared is not None and from_disk.shared is not None
    assert own_shared_files() - before == {Path(ours.shared.file), Path(from_disk.shared.file)}
