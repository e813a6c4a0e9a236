"""Weighted rendezvous hashing: adding or removing one engine of N moves about 1/N of the adapters'
first choices, all of them to (or from) that engine — never a reshuffle among the others."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.domain.placements.rendezvous import Candidate, choose, rank, unit_hash

ADAPTERS = 1000
engine_names = st.lists(st.from_regex(r"[a-z][a-z0-9-]{0,11}", fullmatch=True), min_size=3, max_size=13,
                        unique=True)


def firsts(prefix: str, engines: list[str], weights: dict[str, float] | None = None) -> list[str]:
    weights = weights or {}
    return [rank(f"{prefix}/{i}", [Candidate(e, weights.get(e, 1.0)) for e in engines])[0] for i in range(ADAPTERS)]


def tolerance(p: float) -> float:
    return 5 * math.sqrt(p * (1 - p) / ADAPTERS) + 0.01  # five standard deviations of the binomial share


@settings(max_examples=40, deadline=None)
@given(engines=engine_names, prefix=st.from_regex(r"[a-z]{1,8}", fullmatch=True))
def test_adding_one_engine_moves_about_one_in_n_plus_one_and_only_to_it(engines: list[str], prefix: str) -> None:
    old, new = engines[:-1], engines
    joined = engines[-1]
    before, after = firsts(prefix, old), firsts(prefix, new)
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert all(a == joined for _, a in moved)  # nobody moves between the old engines
    share = len(moved) / ADAPTERS
    assert abs(share - 1 / len(new)) <= tolerance(1 / len(new)), (share, len(new))


@settings(max_examples=40, deadline=None)
@given(engines=engine_names, prefix=st.from_regex(r"[a-z]{1,8}", fullmatch=True), gone=st.integers(0, 12))
def test_removing_one_engine_moves_only_its_adapters(engines: list[str], prefix: str, gone: int) -> None:
    left = engines[gone % len(engines)]
    before = firsts(prefix, engines)
    after = firsts(prefix, [e for e in engines if e != left])
    for b, a in zip(before, after, strict=True):
        assert a == b or b == left  # only the leaving engine's adapters move
    share = before.count(left) / ADAPTERS
    assert abs(share - 1 / len(engines)) <= tolerance(1 / len(engines))


def test_a_heavier_engine_is_first_choice_in_proportion_to_its_weight() -> None:
    chosen = firsts("w", ["light", "heavy"], {"light": 1.0, "heavy": 3.0})
    assert abs(chosen.count("heavy") / ADAPTERS - 0.75) <= tolerance(0.75)


def test_the_order_is_stable_and_the_hash_stays_inside_the_unit_interval() -> None:
    engines = [Candidate(f"e{i}", 1.0) for i in range(5)]
    assert rank("org/a", engines) == rank("org/a", list(reversed(engines)))  # input order does not matter
    assert choose("org/a", engines, 2) == rank("org/a", engines)[:2]
    assert choose("org/a", engines, 0) == []
    assert all(0 < unit_hash(f"a{i}", "e") < 1 for i in range(1000))
