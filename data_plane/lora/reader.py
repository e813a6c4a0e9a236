"""Reads and validates adapter files off the event loop, on threads of lower OS priority.

On a small host the engine's forward pass uses every core; a file read at normal priority would take
one of them mid-step and stretch the inter-token latency of everyone decoding. At a lower nice
value the read only gets the CPU the engine leaves idle. (Linux only; elsewhere it is a plain pool.)

Downloads (artifact_download) go further, to SCHED_IDLE: on 2 CPUs the core's two OpenMP threads wait
for each other at every parallel region, so even a nice-10 thread's share of one CPU (about a tenth)
stalls the whole step; an idle-class thread runs only when a CPU has nothing else to do. Reads stay
at nice 10: a request may be waiting for its adapter's re-read, and an idle-class thread could wait
for as long as the engine is busy. A download is not on any request's path (the load waits, not a
request), and while the engine is idle it runs at full speed.

Both run torch on one thread. Torch's first parallel op on a thread starts an OpenMP team of its own for
it (one more thread, spinning between ops), so a reader that casts or checks an adapter's tensors ran
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
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
READER_NICENESS = 10


def one_torch_thread() -> None:
    """Torch ops on this thread run on it alone, without an OpenMP team (module docstring)."""
    import torch

    torch.get_num_threads()  # torch's per-thread set-up first, which would override what follows
    with contextlib.suppress(AttributeError, OSError):  # no OpenMP runtime loaded: nothing to limit
        ctypes.CDLL(None).omp_set_num_threads(1)  # this thread's OpenMP ICV only


def lower_thread_priority() -> None:
    """This thread at nice READER_NICENESS (Linux), with torch on one thread."""
    one_torch_thread()
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not permitted: reading still works
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), READER_NICENESS)


def idle_thread_priority() -> None:
    """This thread in the SCHED_IDLE class (Linux lets any thread lower itself to it); else nice."""
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        lower_thread_priority()
        return
    one_torch_thread()


_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lora-read", initializer=lower_thread_priority)
# Downloads hold their thread for a whole file: a pool of their own, so that they never keep reads waiting.
_fetch_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lora-fetch", initializer=idle_thread_priority)


async def read_off_loop(fn: Callable[..., T], *args: object) -> T:
    return await asyncio.get_running_loop().run_in_executor(_pool, functools.partial(fn, *args))


async def fetch_off_loop(fn: Callable[..., T], *args: object) -> T:
    return await asyncio.get_running_loop().run_in_executor(_fetch_pool, functools.partial(fn, *args))
