"""Periodic, the loop of the control plane's background rounds: it runs the callable again and again, a
round that raises is logged and the next one still comes, and after `stop` no round runs."""

from __future__ import annotations

import asyncio
import logging

import pytest

from control_plane.periodic import Periodic


async def test_rounds_repeat_failures_are_logged_and_stop_ends_them(caplog: pytest.LogCaptureFixture) -> None:
    rounds: list[int] = []
    second_done = asyncio.Event()

    async def work() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            raise RuntimeError("the first round breaks")
        if len(rounds) == 3:
            second_done.set()

    periodic = Periodic("test-rounds", 0.01, work, what="the test's round", immediately=True)
    with caplog.at_level(logging.ERROR, logger="control_plane.periodic"):
        await periodic.start()
        await periodic.start()  # a second start runs no second loop
        await asyncio.wait_for(second_done.wait(), timeout=30)
        await periodic.stop()
    assert rounds[:3] == [0, 1, 2]
    failures = [r for r in caplog.records if r.getMessage() == "the test's round failed"]
    assert len(failures) == 1 and failures[0].exc_info is not None
    after_stop = len(rounds)
    await asyncio.sleep(0.05)  # several intervals: a loop still running would have added rounds
    assert len(rounds) == after_stop
    await periodic.stop()  # stopping twice is harmless


async def test_without_immediately_the_first_round_waits_one_interval() -> None:
    ran = asyncio.Event()

    async def work() -> None:
        ran.set()

    periodic = Periodic("test-later", 3600, work, what="a round an hour away")
    await periodic.start()
    await asyncio.sleep(0.05)
    assert not ran.is_set()
    await periodic.stop()
