"""The adapter reader threads run torch on one thread, and leave every other thread's count alone."""

from __future__ import annotations

import asyncio
import threading

import torch

from data_plane.lora.reader import read_off_loop


def _torch_threads_here() -> int:
    torch.randn(512, 512).T.contiguous().abs().max()  # parallel ops: an OpenMP team would start here
    return torch.get_num_threads()


def test_reader_threads_use_one_torch_thread_and_others_keep_theirs():
    before = torch.get_num_threads()
    assert asyncio.run(read_off_loop(_torch_threads_here)) == 1
    assert torch.get_num_threads() == before  # the caller's own count is untouched
    later: list[int] = []
    thread = threading.Thread(target=lambda: later.append(_torch_threads_here()))  # started after the reader
    thread.start()
    thread.join()
    assert later == [before]
