"""Demand scaling's decision function, driven by a fake clock: up after a window of high load, down
after the idle time, a window of cool-down between changes, never past min, max or the engines."""

from __future__ import annotations

from control_plane.domain.placements.scaling import ScaleFigures, ScalePolicy, ScaleState, decide

POLICY = ScalePolicy(load_per_replica=8, window_s=30, idle_s=300)


def figures(waiting: int = 0, running: int = 0, replicas: int = 1, target: int = 1, low: int = 1,
            ceiling: int = 3) -> ScaleFigures:
    return ScaleFigures(waiting=waiting, running=running, replicas=replicas, target=target, min=low, ceiling=ceiling)


def run(steps: list[tuple[float, ScaleFigures]], state: ScaleState | None = None) -> list[tuple[float, int, int]]:
    """Feed the figures at their times; the (time, from, to) of each decision."""
    state = state or ScaleState()
    out = []
    for now, f in steps:
        state, decision = decide(POLICY, state, f, now)
        if decision is not None:
            out.append((now, decision.source, decision.target))
    return out


def test_a_high_load_for_a_whole_window_adds_one_replica() -> None:
    high = figures(waiting=10, running=2)  # 12 per replica > 8
    assert run([(t, high) for t in range(0, 30)]) == []  # 29 s is not a window
    assert run([(t, high) for t in range(0, 31)]) == [(30, 1, 2)]


def test_a_break_in_the_high_load_starts_the_window_again() -> None:
    high, low = figures(waiting=12), figures(waiting=3)
    steps = [(t, high) for t in range(0, 20)] + [(20, low)] + [(t, high) for t in range(21, 52)]
    assert run(steps) == [(51, 1, 2)]


def test_load_is_per_current_replica() -> None:
    assert run([(t, figures(waiting=12, replicas=2, target=2)) for t in range(0, 40)]) == []  # 6 per replica


def test_cool_down_of_one_window_between_changes_and_never_above_the_ceiling() -> None:
    state = ScaleState()
    decisions = []
    target = 1
    for t in range(0, 200):
        state, d = decide(POLICY, state, figures(waiting=100, replicas=target, target=target, ceiling=3), t)
        if d is not None:
            decisions.append((t, d.source, d.target))
            target = d.target
    assert decisions == [(30, 1, 2), (60, 2, 3)]  # then the ceiling (max or engines) holds it at 3


def test_idleness_gives_replicas_back_down_to_min() -> None:
    state = ScaleState()
    target, decisions = 3, []
    for t in range(0, 700):
        state, d = decide(POLICY, state, figures(replicas=target, target=target, low=1), t)
        if d is not None:
            decisions.append((t, d.source, d.target))
            target = d.target
    assert decisions == [(300, 3, 2), (330, 2, 1)]  # the second after a window's cool-down; never below min


def test_demand_ends_idleness_and_a_load_between_idle_and_high_changes_nothing() -> None:
    some = figures(waiting=2, replicas=2, target=2)
    steps = [(t, figures(replicas=2, target=2)) for t in range(0, 299)] + [(299, some)]
    steps += [(t, figures(replicas=2, target=2)) for t in range(300, 599)]
    assert run(steps) == []  # idle 0..298, busy at 299, idle again from 300: 299 s < 300 s
    assert run([(t, some) for t in range(0, 1000)]) == []


def test_a_decision_says_why_with_its_figures() -> None:
    state, d = decide(POLICY, ScaleState(high_since=0), figures(waiting=20, running=4, replicas=2, target=2), 45)
    assert d is not None and (d.source, d.target) == (2, 3)
    assert "12.0" in d.reason and "above 8" in d.reason and "45s" in d.reason
    assert d.figures["waiting"] == 20 and d.figures["running"] == 4 and d.figures["load_per_replica"] == 12
    assert state.last_change_at == 45 and state.last_decision == d.dump() and d.dump()["from"] == 2


def test_the_bookkeeping_round_trips_and_keeps_other_keys() -> None:
    state = ScaleState.load({"high_since": 5.0, "leaving": [3, 4]})
    assert state.high_since == 5.0 and state.extra == {"leaving": [3, 4]}
    assert ScaleState.load(state.dump()).dump() == {"high_since": 5.0, "leaving": [3, 4]}
