"""The closeness rule for greedy outputs of two implementations in a low-precision dtype (vLLM's
`check_logprobs_close`): walking both token sequences, each position either has the same greedy token,
or each greedy token is among the other side's top-k logprobs, and the comparison stops there, since
the two continuations differ from then on. Anything else is a mismatch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Greedy:
    """One side's greedy continuation: the token at each position and that position's top-k
    {token id: logprob} (it may hold more than k entries, e.g. the sampled token beside the top-k)."""

    tokens: Sequence[int]
    top: Sequence[Mapping[int, float]]


@dataclass(frozen=True)
class Closeness:
    agreed: int  # positions compared with the same token before the comparison stopped or ended
    diverged_at: int | None  # the position of a tolerated divergence (each token in the other's top-k)
    mismatch: str | None  # why the rule is broken; None when the two are close

    @property
    def close(self) -> bool:
        return self.mismatch is None


def compare(ours: Greedy, reference: Greedy) -> Closeness:
    """The rule applied to two continuations of the same prompt; unequal lengths are a mismatch."""
    if len(ours.tokens) != len(reference.tokens):
        return Closeness(0, None, f"lengths differ: {len(ours.tokens)} against {len(reference.tokens)}")
    for position, (mine, theirs) in enumerate(zip(ours.tokens, reference.tokens, strict=True)):
        if mine == theirs:
            continue
        if mine in reference.top[position] and theirs in ours.top[position]:
            return Closeness(position, position, None)
        return Closeness(position, None, (
            f"position {position}: token {mine} against {theirs}, not each in the other's top-k "
            f"(ours {dict(ours.top[position])}, reference {dict(reference.top[position])})"
        ))
    return Closeness(len(ours.tokens), None, None)


def assert_close(ours: Sequence[Greedy], reference: Sequence[Greedy], names: Sequence[str]) -> list[Closeness]:
    """Every pair close (AssertionError naming each pair that is not); the results, pair by pair."""
    results = [compare(a, b) for a, b in zip(ours, reference, strict=True)]
    failures = [f"{name}: {r.mismatch}" for name, r in zip(names, results, strict=True) if not r.close]
    assert not failures, "not close:\n" + "\n".join(failures)
    return results
