"""Background work beside the engine's steps: threads of lower OS priority, paced while the engine serves.
Adapter reads (data_plane/adapters), downloads and the cache's writes (data_plane/adapters/artifacts) and
the slots' images (data_plane/lora/slot_pool.py) run here. Torch-free: the artifact side uses it too.

On a small host the engine's forward pass uses every core; a file read at normal priority would take
one of them mid-step and stretch the inter-token latency of everyone decoding. At a lower nice
value the read only gets the CPU the engine leaves idle. (Linux only; elsewhere it is a plain pool.)

Downloads and the cache's writes (adapters/artifacts/download.py, cache.py) move hundreds of megabytes, so
they are also paced (`BackgroundPace`): while the engine has requests, such a thread rests after each
piece of work so that it uses at most BUSY_CPU_SHARE of one CPU; while the engine is idle it runs at
full speed. Priority alone cannot do this on 2 CPUs: the core's two OpenMP threads wait for each
other at every parallel region, so a nice-10 thread running flat out stalls every step, and an
idle-class (SCHED_IDLE) thread never runs while the engine decodes, so a fetch (and the request waiting
for its adapter) would wait for the streams to end. Why: see docs/performance.md#artifacts.

Both run torch on one thread. Torch's first parallel op on a thread starts an OpenMP team of its own for
it (one more thread, spinning between ops), so a reader that casts or checks an adapter's tensors would run
two threads against the engine's two on a 2-CPU host; an adapter's few megabytes gain nothing from a
second core. The limit is that thread's own OpenMP setting (torch.set_num_threads would also change
the count that threads started later begin with, the engine's among them).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
# The nice value of background threads and adapter reader processes. Not lower: a reader thread shares the
# API process's GIL, and one descheduled while it holds the GIL keeps the event loop (every stream's next
# token) waiting. Loads from disk run in adapter reader processes (data_plane/adapters/loading/
# reader_process.py) at this nice value; these threads only wait for them. Why: docs/performance.md#hot-loads
READER_NICENESS = 10
# while the engine has requests, what a background thread (download, cache write) may use of one CPU
BUSY_CPU_SHARE = 0.25
# what an adapter reader process may use of one CPU while the engine has requests, resting after each piece
# of PACE_PIECE_S: the streams' inter-token latency falls with the share. Why: docs/performance.md#hot-loads
READER_BUSY_CPU_SHARE = 0.1
PACE_PIECE_S = 0.0005


def one_torch_thread() -> None:
    """Torch ops on this thread run on it alone, without an OpenMP team (module docstring). Nothing to do
    in a process without torch: this module never imports it (the artifact side runs without torch)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    torch.get_num_threads()  # torch's per-thread set-up first, which would override what follows
    with contextlib.suppress(AttributeError, OSError):  # no OpenMP runtime loaded: nothing to limit
        ctypes.CDLL(None).omp_set_num_threads(1)  # this thread's OpenMP ICV only


def lower_thread_priority() -> None:
    """This thread at nice READER_NICENESS (Linux), with torch on one thread."""
    one_torch_thread()
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not permitted: reading still works
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), READER_NICENESS)


_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lora-read", initializer=lower_thread_priority)
# Downloads hold their thread for a whole file: a pool of their own, so that they never keep reads waiting.
_fetch_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lora-fetch", initializer=lower_thread_priority)


async def read_off_loop(fn: Callable[..., T], *args: object) -> T:
    return await asyncio.get_running_loop().run_in_executor(_pool, functools.partial(fn, *args))


async def fetch_off_loop(fn: Callable[..., T], *args: object) -> T:
    return await asyncio.get_running_loop().run_in_executor(_fetch_pool, functools.partial(fn, *args))


class BackgroundPace:
    """Paces a background thread's bulk work (a download's receive and hash, the cache's writes).

    The thread calls `rest(work_s)` after each piece of work with the seconds it took (CPU seconds for a
    download, whose waits for bytes are the sender's pace; wall seconds for a write, whose waits on the
    disk cost the host too). While `busy()` (the engine has requests), it then sleeps so that the thread
    uses at most `share` of one CPU: a large download then takes longer instead of stalling every decode
    step, and it always makes progress. While the engine is idle it does not sleep at all."""

    def __init__(self, busy: Callable[[], bool] = lambda: False, share: float = BUSY_CPU_SHARE) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.busy = busy
        self.share = share
        self.rested_s = 0.0  # seconds background work has waited for the engine (every thread's)
        self._lock = threading.Lock()

    def rest(self, work_s: float) -> None:
        if work_s > 0 and self.share < 1 and self.busy():
            pause = work_s * (1 - self.share) / self.share
            time.sleep(pause)
            with self._lock:
                self.rested_s += pause


class CpuPace:
    """Called between small pieces of one thread's work (an adapter's tensors, a file's hash by the MiB):
    once the thread has used PACE_PIECE_S of CPU since it last rested, it rests (`pace.rest`). The engine's
    OpenMP threads wait for each other at every parallel region, so a reader that takes a CPU from one of
    them for a whole load lengthens one step by the load's whole CPU time; in pieces, each step is
    lengthened by about `share` at most."""

    def __init__(self, pace: BackgroundPace) -> None:
        self.pace = pace
        self._mark = time.thread_time()

    def __call__(self) -> None:
        work = time.thread_time() - self._mark
        if work >= PACE_PIECE_S:
            self.pace.rest(work)
            self._mark = time.thread_time()
