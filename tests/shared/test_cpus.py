"""shared/cpus.py: the CPUs this process may run on."""

from __future__ import annotations

import os

import pytest

from shared import cpus


def test_the_affinity_mask_where_there_is_one() -> None:
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no affinity mask on this OS")
    assert cpus.available_cpus() == sorted(os.sched_getaffinity(0))


def test_every_cpu_without_an_affinity_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert cpus.available_cpus() == [0, 1, 2]
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # unknown: at least the one this runs on
    assert cpus.available_cpus() == [0]
