"""Adapter weights cross in shared memory: the same tensors on the other side, only the layout on the socket,
and the file is the API process's (the loaded adapter's own), never copied again nor removed by the core."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from data_plane.adapters.loading.transfer import open_adapter, share_adapter
from data_plane.engine.core import messages as m
from data_plane.lora.weights import LoRAAdapterWeights
from tests.data_plane.adapters.loading.shared_files import own_shared_files, unshared


def assert_same_weights(got: LoRAAdapterWeights, want: LoRAAdapterWeights) -> None:
    assert (got.description, got.path) == (want.description, want.path)
    assert got.layers.keys() == want.layers.keys()
    for index, modules in want.layers.items():
        assert got.layers[index].keys() == modules.keys()
        for name, module in modules.items():
            g = got.layers[index][name]
            assert torch.equal(g.a_t, module.a_t) and torch.equal(g.b_t, module.b_t)
            assert torch.equal(g.lora_a, module.lora_a) and g.scaling == module.scaling
            assert g.a_t.is_contiguous() and g.b_t.is_contiguous()  # what slot writes copy from


def test_a_loaded_adapter_is_handed_over_as_its_own_file_with_nothing_written(demo_adapter):
    assert demo_adapter.shared is not None
    before = os.stat(demo_adapter.shared.file)
    files = own_shared_files()
    shared = share_adapter(demo_adapter)
    assert shared.file == demo_adapter.shared.file and own_shared_files() == files  # no new file
    after = os.stat(shared.file)  # … and nothing written to the old one
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)
    # the layout crosses the socket, the tensors do not (no timing: on a loaded host it was flaky)
    assert len(m.encoder.encode(m.ShipAdapter(1, shared))) < 64 * 1024 < shared.size
    back = open_adapter(m.core_decoder.decode(m.encoder.encode(m.ShipAdapter(1, shared))).adapter)
    assert_same_weights(back, demo_adapter)
    assert os.path.exists(shared.file)  # the core leaves it: the API may hand it over again later
    assert share_adapter(demo_adapter) == shared


def test_weights_built_otherwise_are_copied_once_into_a_file_they_own(demo_adapter):
    weights = unshared(demo_adapter)
    files = own_shared_files()
    shared = share_adapter(weights)
    assert weights.shared is not None and weights.shared.file == shared.file
    assert own_shared_files() == files | {Path(shared.file)}
    assert share_adapter(weights) == shared and own_shared_files() == files | {Path(shared.file)}  # once
    assert_same_weights(open_adapter(shared), demo_adapter)
    del weights
    gc.collect()
    assert not os.path.exists(shared.file)


def test_a_file_that_is_gone_cannot_be_opened(demo_adapter):
    weights = unshared(demo_adapter)
    shared = share_adapter(weights)
    weights.shared.remove()
    with pytest.raises(FileNotFoundError):
        open_adapter(shared)
    assert not os.path.exists(shared.file)  # and mapping it made no new (zeroed) file
