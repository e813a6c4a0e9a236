"""Time spent in tensor-parallel collectives on this rank (read by bench/tp_overhead.py).

Two perf_counter calls per collective: nothing next to the collective itself, and never on one device.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class CommStats:
    seconds: float = 0.0
    calls: int = 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


COMM_STATS = CommStats()


@contextmanager
def timed_collective() -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        COMM_STATS.seconds += time.perf_counter() - start
        COMM_STATS.calls += 1
