"""HostCopies: which adapters' host copies the engine core holds, handed over once and dropped least
recently used first, never while a request of them is in flight; the file lives until the core is told."""

from __future__ import annotations

import gc
import os

from data_plane.engine.core import messages as m
from data_plane.engine.core.host_copies import HostCopies
from tests.data_plane.adapters.loading.shared_files import unshared


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


def test_a_handed_over_file_lives_until_the_core_is_told_to_drop_it(demo_adapter):
    """The core maps the file when it reads the hand-over, which may be after the registry dropped the
    weights: HostCopies keeps them (and so the file) until it tells the core to drop its copy."""
    sent: list[object] = []
    copies = HostCopies(1, sent.append)
    weights = unshared(demo_adapter)
    copies.acquire(1, weights)
    file = weights.shared.file
    copies.release(1)
    del weights  # the registry dropped its host copy
    gc.collect()
    assert os.path.exists(file)
    copies.acquire(2, demo_adapter)  # over capacity: 1 is dropped in the core, and its file here
    assert isinstance(sent[-1], m.ForgetAdapter) and sent[-1].adapter_id == 1
    gc.collect()
    assert not os.path.exists(file)
