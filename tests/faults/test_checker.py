"""The fault suite's answer check catches what it is there to catch (it runs on recorded outcomes, so
these cases need no processes): another adapter's or the base model's answer, a replaced version after
the fleet converged, a 404 while the adapter is served, a silent engine nobody faulted, a 500."""

from __future__ import annotations

import time

from tests.faults.driver import ABSENT, FaultLog, Outcome, Timeline, check

EXPECTED = {"base": "base text", "a1": "first version", "a2": "second version", "b1": "other adapter"}


def _timeline() -> tuple[Timeline, float]:
    timeline = Timeline()
    timeline.change("a", "a1")
    timeline.change("b", "b1")
    timeline.converged()
    time.sleep(0.01)
    switched = time.monotonic()
    timeline.change("a", "a2")
    return timeline, switched


def _ok(outcome: Outcome, timeline: Timeline, faults: FaultLog | None = None) -> bool:
    return check([outcome], timeline, EXPECTED, faults or FaultLog()) == []


def test_only_an_active_version_of_the_same_adapter_is_right() -> None:
    timeline, switched = _timeline()
    now = time.monotonic()
    assert _ok(Outcome("e1", "a", now, now, 200, "second version"), timeline)
    assert _ok(Outcome("e1", "a", now, now, 200, "first version"), timeline)  # not converged yet
    assert not _ok(Outcome("e1", "a", now, now, 200, "other adapter"), timeline)
    assert not _ok(Outcome("e1", "a", now, now, 200, "base text"), timeline)
    timeline.converged()
    time.sleep(0.01)
    later = time.monotonic()
    assert not _ok(Outcome("e1", "a", later, later, 200, "first version"), timeline)  # replaced for good
    assert _ok(Outcome("e1", "a", switched - 1, later, 200, "first version"), timeline)  # started before


def test_404_only_while_absent_or_on_a_faulted_engine() -> None:
    timeline, _ = _timeline()
    timeline.converged()
    now = time.monotonic()
    assert not _ok(Outcome("e1", "a", now, now, 404), timeline)
    faults = FaultLog()
    faults.open("e1")
    assert _ok(Outcome("e1", "a", now, time.monotonic(), 404), timeline, faults)
    timeline.change("a", ABSENT)
    assert _ok(Outcome("e2", "a", time.monotonic(), time.monotonic(), 404), timeline)


def test_no_answer_only_from_a_faulted_engine_and_no_5xx_but_503() -> None:
    timeline, _ = _timeline()
    faults = FaultLog()
    faults.open("e1")
    faults.close_all()
    time.sleep(0.01)
    now = time.monotonic()
    assert not _ok(Outcome("e1", "a", now, now, None, error="ConnectError"), timeline, faults)
    assert _ok(Outcome("e1", "a", now - 1, now, None, error="ReadError"), timeline, faults)
    assert _ok(Outcome("e2", "a", now, now, 503), timeline)
    assert not _ok(Outcome("e2", "a", now, now, 500), timeline)
    assert not _ok(Outcome("e2", "a", now, now, 400), timeline)
