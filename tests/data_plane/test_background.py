"""The adapter reader threads run torch on one thread, and leave every other thread's count alone;
background adapter work rests while the engine is busy, in proportion to the CPU it took, and an adapter
reader's in pieces of a bounded length."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time

import pytest
import torch

from data_plane.background import PACE_PIECE_S, BackgroundPace, CpuPace, read_off_loop


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


def _paced_work(pace: BackgroundPace, pieces: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of hashing `pieces` MiB, resting after each piece as a download does."""
    data = bytes(1 << 20)
    cpu = 0.0
    started = time.perf_counter()
    for _ in range(pieces):
        before = time.thread_time()
        hashlib.sha256(data).digest()
        took = time.thread_time() - before
        cpu += took
        pace.rest(took)
    return cpu, time.perf_counter() - started


def test_background_work_rests_only_while_the_engine_is_busy():
    busy = [True]
    pace = BackgroundPace(lambda: busy[0], share=0.25)
    cpu, wall = _paced_work(pace, 16)
    # at most a quarter of a CPU: it waited three times the CPU it used (sleep never returns early)
    assert pace.rested_s == pytest.approx(3 * cpu) and wall >= 4 * cpu * 0.99
    busy[0] = False
    rested = pace.rested_s
    _paced_work(pace, 16)
    assert pace.rested_s == rested  # an idle engine: full speed
    with pytest.raises(ValueError, match="share"):
        BackgroundPace(share=0)


def test_cpu_pace_rests_once_a_piece_of_cpu_is_used_in_proportion_to_it():
    pace = BackgroundPace(lambda: True, share=0.1)
    paced = CpuPace(pace)
    data = bytes(1 << 14)  # 16 KiB a call: a few microseconds, far below a piece
    started = time.thread_time()
    rests = 0
    for _ in range(2000):
        hashlib.sha256(data).digest()
        before = pace.rested_s
        paced()
        rests += pace.rested_s > before
    cpu = time.thread_time() - started
    assert 1 <= rests <= cpu / PACE_PIECE_S + 1  # not after every call: after each piece of CPU
    # nine times the CPU each rest followed, at a tenth of a CPU: the work's, not the rests' own (the sleeps'
    # system calls, uncounted, are most of the gap)
    assert 0.6 * 9 * cpu <= pace.rested_s <= 9 * cpu
