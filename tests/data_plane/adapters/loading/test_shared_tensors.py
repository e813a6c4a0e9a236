"""Tensors in one shared-memory file: views of one mapping, the file owned by its layout, orphans swept."""

from __future__ import annotations

import gc
import os
import pickle
import stat
import subprocess
from pathlib import Path

import pytest
import torch

from data_plane.adapters.loading.peft_loader import load_peft_adapter
from data_plane.adapters.loading.shared_tensors import (
    ALIGN,
    allocate,
    file_prefix,
    map_file,
    shm_dir,
    sweep_orphans,
    view,
)
from data_plane.model.config import ModelConfig
from tests.data_plane.adapters.loading.shared_files import inside, mappings_of


def test_views_lie_in_one_mapping_of_the_file_and_another_mapping_sees_them():
    shapes = {(0, "q_proj", "a_t"): [64, 3], (0, "q_proj", "b_t"): [3, 5], (1, "o_proj", "a_t"): [0, 4]}
    views, layout = allocate(shapes, torch.bfloat16)
    assert stat.S_IMODE(os.stat(layout.file).st_mode) == 0o600  # the core runs as this user; nobody else reads it
    assert Path(layout.file).name.startswith(file_prefix(os.getpid()))
    assert all(span.offset % ALIGN == 0 for span in layout.spans.values())
    ranges = mappings_of(layout.file)
    for key, v in views.items():
        assert list(v.shape) == shapes[key] and v.dtype == torch.bfloat16 and v.is_contiguous()
        assert v.numel() == 0 or inside(v, ranges), key
        v.copy_(torch.randn(v.shape))
    again = map_file(layout.file, layout.size)  # what the core does
    for key, span in layout.spans.items():
        assert torch.equal(view(again, torch.bfloat16, span), views[key])


def test_the_file_goes_with_its_layout_and_mappings_keep_their_pages():
    views, layout = allocate({(0, "q_proj", "a_t"): [256, 8]}, torch.float32)
    views[(0, "q_proj", "a_t")].fill_(2.0)
    file = layout.file
    layout.remove()  # what a refused load does
    assert not os.path.exists(file)
    assert views[(0, "q_proj", "a_t")].sum().item() == 2.0 * 256 * 8
    views, layout = allocate({(0, "q_proj", "a_t"): [4, 4]}, torch.float32)
    file = layout.file
    del layout
    gc.collect()
    assert not os.path.exists(file)


def test_mapping_a_file_that_is_gone_fails_and_makes_none(tmp_path):
    # torch.from_file(shared=True) would make a new zeroed file here: an adapter of zeros, and a leftover
    with pytest.raises(FileNotFoundError):
        map_file(str(tmp_path / "gone"), 4096)
    assert not (tmp_path / "gone").exists()
    short = tmp_path / "short"
    short.write_bytes(b"x" * 10)
    with pytest.raises(OSError, match="holds 10 bytes"):
        map_file(str(short), 4096)


def test_sweep_removes_the_files_of_dead_owners_only():
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid names no process now
    orphan = shm_dir() / f"{file_prefix(dead.pid)}left"
    mine = shm_dir() / f"{file_prefix(os.getpid())}kept"
    other = shm_dir() / "loraplane-adapter-notapid"
    for path in (orphan, mine, other):
        path.write_bytes(b"x")
    try:
        removed = sweep_orphans()
        assert orphan in removed and not orphan.exists()
        assert mine.exists() and other.exists()
    finally:
        for path in (orphan, mine, other):
            path.unlink(missing_ok=True)


def test_weights_on_a_shared_file_pickle_only_their_own_bytes(tiny_checkpoints, peft_adapters):
    """A tensor-parallel slot write pickles the weights: each view must not carry the whole file."""
    adapter = peft_adapters("llama", "patterns")
    weights = load_peft_adapter(adapter, ModelConfig.from_pretrained(tiny_checkpoints["llama"]), max_rank=64,
                                allowed_roots=[str(adapter.parent)])
    assert weights.shared is not None
    modules = [m for mods in weights.layers.values() for m in mods.values()]
    tensor_bytes = sum(m.a_t.nbytes + m.b_t.nbytes for m in modules)
    data = pickle.dumps(weights)
    assert len(data) < tensor_bytes + 50_000 < len(modules) * weights.shared.size
    back = pickle.loads(data)
    assert back.shared is None and back.description == weights.description  # the copy does not own the file
    for index, mods in weights.layers.items():
        for name, m in mods.items():
            got = back.layers[index][name]
            assert torch.equal(got.a_t, m.a_t) and torch.equal(got.lora_b, m.lora_b) and got.scaling == m.scaling
    assert os.path.exists(weights.shared.file)
