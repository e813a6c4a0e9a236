"""Weighted rendezvous hashing (highest random weight): which engines an adapter prefers, in order.

Every (adapter, engine) pair gets a pseudo-random number u in (0, 1) from a hash of the two names; the
engine's score for the adapter is `-weight / ln(u)`, and the adapter ranks engines by descending score.
For equal weights this is plain rendezvous hashing; with weights, engine e is an adapter's first choice
with probability weight(e) / Σ weight (the logarithm makes the scores exponentially distributed).

Why this and not a ring: each adapter's order of engines depends only on its own pairs, so

- removing an engine changes the first choice only of the adapters that ranked it first (about 1/N of
  them), and they move to their second choice; nobody else moves;
- adding an engine moves only the adapters that now rank it first (about 1/(N+1)), all to it;

never a reshuffle. Names are hashed, not database ids: an engine that deregisters and registers again
under its name gets its adapters back.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

_SPAN = float(1 << 64)


def unit_hash(adapter: str, engine: str) -> float:
    """u in (0, 1), uniform over pairs: blake2b of the two names (0 and 1 themselves never occur)."""
    digest = hashlib.blake2b(f"{adapter}\x00{engine}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 0.5) / _SPAN


def score(adapter: str, engine: str, weight: float) -> float:
    """The engine's score for the adapter: higher is preferred. `weight` must be positive."""
    return -weight / math.log(unit_hash(adapter, engine))


@dataclass(frozen=True)
class Candidate:
    """An engine as rendezvous hashing sees it: its name and a positive weight (free capacity)."""

    name: str
    weight: float


def rank(adapter: str, candidates: Iterable[Candidate]) -> list[str]:
    """The candidates' names, the adapter's most preferred first (ties, practically impossible, by name)."""
    scored = sorted(((score(adapter, c.name, c.weight), c.name) for c in candidates), key=lambda s: (-s[0], s[1]))
    return [name for _, name in scored]


def choose(adapter: str, candidates: Iterable[Candidate], count: int) -> list[str]:
    """The adapter's `count` most preferred candidates."""
    return rank(adapter, candidates)[:max(count, 0)]
