"""The closeness rule on hand-made continuations: agreement, a tolerated divergence, and each way to break it."""

from __future__ import annotations

import pytest

from tests.data_plane.bfloat16.closeness import Greedy, assert_close, compare

TOP = {7: -0.1, 8: -2.0, 9: -3.0}  # one position's top-k: 7 first, then 8 and 9


def greedy(tokens: list[int], tops: list[dict[int, float]] | None = None) -> Greedy:
    return Greedy(tokens, tops or [TOP] * len(tokens))


def test_equal_continuations_are_close_over_every_position() -> None:
    result = compare(greedy([7, 7, 7]), greedy([7, 7, 7]))
    assert (result.close, result.agreed, result.diverged_at) == (True, 3, None)


def test_a_divergence_inside_both_top_k_is_tolerated_and_ends_the_comparison() -> None:
    ours = greedy([7, 8, 1, 2], [TOP, {8: -0.5, 7: -0.6}, {1: 0.0}, {2: 0.0}])
    reference = greedy([7, 7, 5, 6])  # after position 1 the two go their own ways: never compared
    result = compare(ours, reference)
    assert (result.close, result.agreed, result.diverged_at) == (True, 1, 1)


@pytest.mark.parametrize(("our_top", "reference_top"), [
    ({8: -0.5, 7: -0.6}, {7: -0.1, 9: -3.0}),  # ours (8) is not in the reference's top-k
    ({8: -0.5, 9: -0.6}, TOP),  # the reference's (7) is not in ours
])
def test_a_divergence_outside_either_top_k_is_a_mismatch(our_top: dict[int, float], reference_top: dict[int, float]) -> None:
    result = compare(greedy([7, 8], [TOP, our_top]), greedy([7, 7], [TOP, reference_top]))
    assert not result.close and result.agreed == 1 and result.diverged_at is None
    assert result.mismatch is not None and result.mismatch.startswith("position 1: token 8 against 7")


def test_the_first_divergence_decides_even_when_later_ones_would_pass() -> None:
    ours = greedy([1, 7], [{1: 0.0}, TOP])
    assert not compare(ours, greedy([7, 7])).close  # position 0: 1 is in no top-k of the reference


def test_unequal_lengths_are_a_mismatch() -> None:
    assert "lengths differ" in (compare(greedy([7]), greedy([7, 7])).mismatch or "")


def test_assert_close_names_each_pair_that_is_not_close() -> None:
    good, bad = greedy([7]), greedy([1], [{1: 0.0}])
    assert [r.agreed for r in assert_close([good, good], [good, good], ["a", "b"])] == [1, 1]
    with pytest.raises(AssertionError, match="b: position 0") as failure:
        assert_close([good, bad], [good, good], ["a", "b"])
    assert "a:" not in str(failure.value)
