"""Rebalancing over many passes on a fleet of realistic shape (pure: replicas.fill places, rebalance.plan_moves
moves, the passes carried out as the fleet pass does): it comes to rest, every pass within its bound, an
engine that leaves moves about 1/N of the adapters and one that returns gets back only adapters that hash
to it. The fleet: 40 engines with 8 device slots and 1,024 host-cache slots (bench/engine_sim.py's), 4,000
adapters of one replica, placed one by one by weighted rendezvous as the control plane's first pass does."""

from __future__ import annotations

import pytest

from control_plane.domain.placements.rebalance import Move, plan_moves
from control_plane.domain.placements.replicas import (
    AdapterPlacement,
    EngineLoad,
    Holder,
    ReplicaRule,
    fill,
)

ENGINES, ADAPTERS, BUDGET = 40, 4_000, 4
RULE = ReplicaRule(min=1, max=3, target=None)


class Fleet:
    def __init__(self) -> None:
        self.loads = {i: EngineLoad(id=i, name=f"sim-{i:03d}", healthy=True, slots=8, host_slots=1024)
                      for i in range(1, ENGINES + 1)}
        matching = list(self.loads)  # one list per base model, as the fleet pass shares it
        self.adapters = [AdapterPlacement(id=i, name=f"seed-{i:06d}", rule=RULE, matching=matching)
                         for i in range(ADAPTERS)]
        self.by_id = {a.id: a for a in self.adapters}
        self._ids = iter(range(1, 10**9))
        self.moving: list[Move] = []
        for a in self.adapters:
            self.place(a)

    def place(self, adapter: AdapterPlacement) -> None:
        """What the fleet pass's fill does for an adapter with no healthy holder (loads counted)."""
        adapter.holders = [Holder(next(self._ids), e, pinned=False, loaded=True) for e in fill(adapter, self.loads, 1)]

    def where(self) -> dict[int, frozenset[int]]:
        return {a.id: frozenset(h.engine_id for h in a.holders) for a in self.adapters}

    def one_pass(self) -> list[Move]:
        """One fleet pass: last pass's moves complete (their targets loaded, their sources released; they
        count against this pass's budget, as moves under way do), then new moves are planned."""
        for move in self.moving:
            a = self.by_id[move.adapter_id]
            a.holders = [Holder(next(self._ids), move.target, pinned=False, loaded=True)]
        budget = BUDGET - len(self.moving)
        self.moving = plan_moves(self.adapters, self.loads, budget, busy=set())
        return self.moving

    def until_rest(self, most: int) -> list[list[Move]]:
        """Passes until one has no move under way and plans none; each pass's moves."""
        passes = []
        while True:
            under_way = bool(self.moving)
            passes.append(self.one_pass())
            if not under_way and not passes[-1]:
                return passes
            assert len(passes) <= most, f"not at rest after {most} passes"


@pytest.fixture(scope="module")
def fleet() -> Fleet:
    return Fleet()


def test_passes_come_to_rest_within_the_bound_and_stay_there(fleet: Fleet) -> None:
    passes = fleet.until_rest(most=20)
    assert all(len(p) <= BUDGET for p in passes)
    at_rest = fleet.where()
    for _ in range(10):  # at rest is at rest: nothing more, pass after pass
        assert fleet.one_pass() == []
    assert fleet.where() == at_rest
    assert all(len(h) == 1 for h in at_rest.values())


def test_an_engine_that_leaves_moves_about_one_in_n_and_gets_back_only_its_own(fleet: Fleet) -> None:
    fleet.until_rest(most=20)
    before = fleet.where()
    gone = 7
    fleet.loads[gone].healthy = False
    for a in fleet.adapters:
        if any(h.engine_id == gone for h in a.holders):
            fleet.place(a)  # re-placed on healthy engines (the fill of the pass after it went stale)
    fleet.loads[gone].loaded = 0
    fleet.until_rest(most=20)
    left = fleet.where()
    moved = [a for a in before if before[a] != left[a]]
    assert all(gone in before[a] for a in moved)  # only its own adapters moved
    assert 0.5 / ENGINES <= len(moved) / ADAPTERS <= 2.0 / ENGINES  # about 1/N

    fleet.loads[gone].healthy = True  # it returns, empty
    passes = fleet.until_rest(most=400)
    assert all(len(p) <= BUDGET for p in passes)
    back = fleet.where()
    returned = [a for a in back if gone in back[a]]
    changed = [a for a in back if back[a] != left[a]]
    assert sorted(changed) == sorted(returned)  # moves go onto the returning engine, nowhere else
    assert all(gone in before[a] for a in returned)  # and bring back adapters that hash to it
    assert len(returned) >= 0.5 * len(moved)  # most of them: it holds much less than the others no more
    for _ in range(10):
        assert fleet.one_pass() == []
