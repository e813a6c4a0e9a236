"""Adapter weights cross in shared memory: the same tensors on the other side, no file left behind."""

from __future__ import annotations

import os

import torch

from data_plane.engine.core import messages as m
from data_plane.engine.core.adapter_transfer import file_prefix, open_adapter, share_adapter, shm_dir, sweep
from data_plane.engine.core.host_copies import HostCopies


def test_the_core_sees_the_same_weights_and_the_file_is_gone(demo_adapter):
    shared = share_adapter(demo_adapter)
    # the layout crosses the socket, the tensors do not
    assert len(m.encoder.encode(m.ShipAdapter(1, shared))) < 64 * 1024 < shared.size
    back = open_adapter(m.core_decoder.decode(m.encoder.encode(m.ShipAdapter(1, shared))).adapter)
    assert not os.path.exists(shared.file)
    assert (back.sha256, back.rank, back.alpha, back.path) == (demo_adapter.sha256, 8, 16, demo_adapter.path)
    assert back.layers.keys() == demo_adapter.layers.keys()
    for index, modules in demo_adapter.layers.items():
        assert back.layers[index].keys() == modules.keys()
        for name, module in modules.items():
            got = back.layers[index][name]
            assert torch.equal(got.a_t, module.a_t) and torch.equal(got.b_t, module.b_t)
            assert torch.equal(got.lora_a, module.lora_a) and got.scaling == module.scaling
            assert got.a_t.is_contiguous() and got.b_t.is_contiguous()  # what slot writes copy from


def test_files_no_core_picked_up_are_swept(demo_adapter):
    shared = share_adapter(demo_adapter)
    assert os.path.basename(shared.file).startswith(file_prefix(os.getpid()))
    sweep(os.getpid())
    assert not os.path.exists(shared.file)
    assert not list(shm_dir().glob(file_prefix(os.getpid()) + "*"))


def test_host_copies_ship_once_and_drop_the_least_recent_idle_one(demo_adapter):
    sent: list[object] = []
    copies = HostCopies(2, sent.append)
    copies.acquire(1, demo_adapter)
    copies.acquire(1, demo_adapter)  # held already: nothing crosses again
    copies.acquire(2, demo_adapter)
    assert [type(s).__name__ for s in sent] == ["ShipAdapter", "ShipAdapter"]
    copies.release(2)
    copies.ensure(3, demo_adapter)  # over capacity: 2 is idle, 1 has requests in flight
    assert isinstance(sent[-1], m.ForgetAdapter) and sent[-1].adapter_id == 2
    assert copies.held() == [1, 3]
    copies.ensure(4, demo_adapter)  # 1 still busy, 3 idle: 3 goes, never the one just handed over
    assert isinstance(sent[-1], m.ForgetAdapter) and sent[-1].adapter_id == 3
    assert copies.held() == [1, 4]
    copies.forget(4)
    assert copies.held() == [1]
    for s in sent:
        if isinstance(s, m.ShipAdapter):
            open_adapter(s.adapter)  # unlinks the file
