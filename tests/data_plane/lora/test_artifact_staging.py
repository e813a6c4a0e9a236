"""TensorStage: a fetched weights file copied into the host layout while it arrives is used only once every
byte matched its sha256 (else nothing of it is left), waits for the download's end while the engine is
busy, and is what the loader adopts (tests/data_plane/lora/test_peft_loader.py's held-bytes tests run
staged too: the same tensors and refusals as from the files)."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from data_plane.lora.artifact_fetch import ArtifactFetcher, ArtifactOrigins
from data_plane.lora.artifact_staging import TensorStage
from data_plane.lora.errors import LoRAAdapterError
from data_plane.lora.peft_loader import load_peft_adapter
from data_plane.lora.reader import BackgroundPace
from data_plane.lora.verified_files import VerifiedFiles
from data_plane.model.config import ModelConfig
from tests.data_plane.lora.artifact_server import ArtifactServer, serve_artifacts
from tests.data_plane.lora.shared_files import own_shared_files

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
    fetcher = ArtifactFetcher(ArtifactOrigins(cp.url), TOKEN, max_bytes=1 << 30, read_timeout_s=5)
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
    assert ours.sha256 == from_disk.sha256
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
    fetcher = ArtifactFetcher(ArtifactOrigins(cp.url), TOKEN, max_bytes=1 << 30, read_timeout_s=5)
    before = own_shared_files()
    try:
        with pytest.raises(LoRAAdapterError, match=f"^checksum mismatch for {WEIGHTS}"):
            await fetcher.receive(await fetcher.manifest(ref))
    finally:
        await fetcher.aclose()
    assert own_shared_files() == before  # the stage's copy of the unverified bytes is gone


def test_while_the_engine_is_busy_the_stage_waits_for_the_last_byte(peft_adapters):
    """Beside a download both would take CPU from the decoding requests: the stage copies nothing (not
    even allocating its file) until the download is over, then all of it."""
    data = bytearray((peft_adapters("llama", "patterns") / WEIGHTS).read_bytes())
    asked = threading.Semaphore(0)

    def busy() -> bool:
        asked.release()
        return True

    before = own_shared_files()
    stage = TensorStage(data, BackgroundPace(busy, share=1.0))
    stage.arrived(len(data))  # every byte is in, but the download has not ended
    for _ in range(3):  # the stage has looked at the engine three times since
        assert asked.acquire(timeout=30)
    assert own_shared_files() == before
    stage.finish()
    assert len(own_shared_files() - before) == 1
    stage.discard()
    assert own_shared_files() == before
