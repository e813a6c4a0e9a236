"""The replica rules as pure functions: counts, weights, fill, release; and rebalancing's bounded moves."""

from __future__ import annotations

from control_plane.domain.placements.rebalance import plan_moves
from control_plane.domain.placements.rendezvous import unit_hash
from control_plane.domain.placements.replicas import (
    LAST_RESORT_WEIGHT,
    AdapterPlacement,
    EngineLoad,
    Holder,
    ReplicaDefaults,
    ReplicaRule,
    fill,
    releasable,
)

DEFAULTS = ReplicaDefaults(min=1, max=3)


def engines(n: int, slots: int = 4, host: int = 16, **health: bool) -> dict[int, EngineLoad]:
    return {i: EngineLoad(id=i, name=f"e{i}", healthy=health.get(f"e{i}", True), slots=slots, host_slots=host)
            for i in range(1, n + 1)}


def adapter(i: int, matching: list[int], holders: list[Holder] | None = None, **rule: int | None) -> AdapterPlacement:
    r = ReplicaRule.of(rule.get("low"), rule.get("high"), rule.get("target"), DEFAULTS)
    return AdapterPlacement(id=i, name=f"a{i}", rule=r, matching=matching, holders=holders or [])


def test_desired_is_target_or_min_clamped_by_max_and_the_engines() -> None:
    assert ReplicaRule.of(None, None, None, DEFAULTS).desired(5) == 1
    assert ReplicaRule.of(2, None, 5, DEFAULTS).desired(5) == 3  # the default max 3
    assert ReplicaRule.of(2, 0, 5, DEFAULTS).desired(4) == 4  # max "all": every engine there is
    assert ReplicaRule.of(3, 4, None, DEFAULTS).desired(2) == 2  # fewer engines than min
    assert ReplicaRule.of(2, 4, 1, DEFAULTS).wanted() == 2  # a target below min is min
    assert ReplicaRule.of(0, None, None, DEFAULTS).desired(3) == 0


def test_weights_count_pinned_first_and_cache_room() -> None:
    e = EngineLoad(id=1, name="e", healthy=True, slots=4, host_slots=16)
    empty = e.weight()
    e.hold(pinned=True, count=4)  # every device slot pinned
    assert e.free == 12 and e.weight() == 1 + 12 < empty
    e.cache_bytes_free = 10
    assert e.weight(size_bytes=11) == LAST_RESORT_WEIGHT and e.weight(size_bytes=10) > LAST_RESORT_WEIGHT
    assert not EngineLoad(id=2, name="r", healthy=True, max_lora_rank=8).takes(16)


def test_fill_adds_healthy_matching_engines_until_desired_and_counts_them() -> None:
    loads = engines(4, e2=False)
    a = adapter(1, [1, 2, 3], [Holder(10, 1, pinned=False, loaded=True)], low=2)
    added = fill(a, loads, a.rule.desired(len(a.able(loads))))
    assert added == [3]  # e2 is unhealthy, e4 serves another base model, e1 holds it already
    assert loads[3].loaded == 1
    assert fill(adapter(2, [4]), loads, 0) == []


def test_placements_are_released_only_once_enough_replicas_are_loaded() -> None:
    loads = engines(3, e1=False)
    on_stale = Holder(10, 1, pinned=False, loaded=True)
    loading = Holder(11, 2, pinned=False, loaded=False)
    a = adapter(1, [1, 2, 3], [on_stale, loading])
    assert releasable(a, loads, desired=1, keep=3) == []  # the replacement is not loaded yet
    a.holders = [on_stale, Holder(11, 2, pinned=False, loaded=True)]
    assert releasable(a, loads, desired=1, keep=3) == [10]
    leaving = Holder(12, 3, pinned=False, loaded=True, leaving=True)
    a.holders = [leaving, loading]
    assert releasable(a, loads, desired=1, keep=3) == []  # a move's source stays until the target is loaded


def test_trimming_lets_go_of_the_least_useful_and_never_below_keep_loaded() -> None:
    loads = engines(3)
    a = adapter(1, [1, 2, 3], [Holder(10, 1, False, True), Holder(11, 2, False, False), Holder(12, 3, False, True)])
    assert releasable(a, loads, desired=1, keep=2) == [11]  # the one not loaded yet goes first
    loads = engines(3)
    a.holders = [Holder(10, 1, False, True), Holder(11, 2, False, False), Holder(12, 3, False, False)]
    assert sorted(releasable(a, loads, desired=1, keep=1)) == [11, 12]  # the loaded one stays
    assert loads[2].loaded == -1 and loads[1].loaded == 0  # the loads follow


def test_rebalancing_is_bounded_moves_from_full_to_empty_and_comes_to_rest() -> None:
    loads = engines(3, slots=2, host=2)
    adapters = []
    for i in range(12):  # e3 came back empty: e1 and e2 hold six each
        holder = Holder(100 + i, 1 + i % 2, pinned=False, loaded=True)
        adapters.append(adapter(i, [1, 2, 3], [holder]))
        loads[holder.engine_id].loaded += 1
    first = plan_moves(adapters, loads, budget=2, busy=set())
    assert len(first) == 2 and {m.target for m in first} == {3}
    moved = 0
    while True:
        moves = plan_moves(adapters, loads, budget=2, busy=set()) if moved else first
        if not moves:
            break
        for move in moves:
            a = next(x for x in adapters if x.id == move.adapter_id)
            assert a.holders[0].engine_id == move.source
            # only towards the adapter's own preference: the reverse is never wanted
            assert unit_hash(a.name, "e3") > unit_hash(a.name, f"e{move.source}")
            a.holders = [Holder(a.holders[0].placement_id, move.target, False, True)]
            moved += 1
        assert moved <= 12
    assert 2 <= loads[3].loaded <= 4 and loads[1].loaded + loads[2].loaded + loads[3].loaded == 12
    assert plan_moves(adapters, loads, budget=100, busy=set()) == []


def test_rebalancing_leaves_pinned_busy_and_foreign_adapters_alone() -> None:
    loads = engines(2)
    pinned = adapter(1, [1, 2], [Holder(10, 1, pinned=True, loaded=True)])
    busy = adapter(2, [1, 2], [Holder(11, 1, pinned=False, loaded=True)])
    foreign = adapter(3, [1], [Holder(12, 1, pinned=False, loaded=True)])
    loads[1].pinned, loads[1].loaded = 1, 2
    assert plan_moves([pinned, busy, foreign], loads, budget=4, busy={2}) == []
