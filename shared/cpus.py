"""The CPUs this process may run on (its affinity mask where the OS has one, else every CPU).

Torch-free: the engine's core threads (data_plane/engine/core/threads.py) and `loraplane up`'s share of
the host among its engines (control_plane/up.py) count the same CPUs.
"""

from __future__ import annotations

import os


def available_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
