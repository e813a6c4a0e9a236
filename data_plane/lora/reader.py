"""Reads and validates adapter files off the event loop, on threads of lower OS priority.

On a small host the engine's forward pass uses every core; a file read at normal priority would take
one of them mid-step and stretch the inter-token latency of everyone decoding. At a lower nice
value the read only gets the CPU the engine leaves idle. (Linux only; elsewhere it is a plain pool.)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
READER_NICENESS = 10


def lower_thread_priority() -> None:
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not permitted: reading still works
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), READER_NICENESS)


_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lora-read", initializer=lower_thread_priority)
# Downloads hold their thread for a whole file: a pool of their own, so that they never keep reads waiting.
_fetch_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lora-fetch", initializer=lower_thread_priority)


async def read_off_loop(fn: Callable[..., T], *args: object) -> T:
    return await asyncio.get_running_loop().run_in_executor(_pool, functools.partial(fn, *args))


async def fetch_off_loop(fn: Callable[..., T], *args: object) -> T:
    return await asyncio.get_running_loop().run_in_executor(_fetch_pool, functools.partial(fn, *args))
