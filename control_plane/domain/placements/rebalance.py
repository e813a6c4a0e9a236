"""Bounded rebalancing, pure: which placements to move onto engines that hold much less than others.

An engine that returns (or joins) holds nothing, while the adapters it held were re-placed elsewhere.
Each fleet pass moves at most `budget` placements (`--rebalance-max-moves`, counting moves still under
way) from the fullest engine to the emptiest one, under two rules that make the passes come to rest:

- only where the target's free capacity exceeds the source's by the gap: `MIN_GAP`, or `REL_GAP` of the
  mean an engine holds, whichever is more. Rendezvous hashing spreads N adapters over E engines with
  a natural spread of about 6·sqrt(N/E) between the fullest and the emptiest; a small fixed gap would
  take that spread for imbalance and move placements every other pass without end
  (docs/performance.md#control-plane). A gap relative to the mean leaves the natural spread alone and
  still sees an engine that came back empty;
- only an adapter that ranks the target above the source in rendezvous order (by the names' hash
  alone): a move takes an adapter nearer its own first choice, so no later pass wants its reverse, and
  since every move strictly lowers the adapters' total distance from their first choices, the moves run
  out. Of those, the adapter that ranks the target highest moves, so a returning engine gets back the
  adapters that hash to it, as when it left (about 1/N of them), and no others.

A move is make-before-break: the new placement is added, the old one marked leaving and released by a
later pass only once the adapter has its desired replicas observed loaded (replicas.releasable), so it
never has fewer than `min` replicas loaded. Pinned adapters and adapters that are already moving or
being re-placed stay where they are.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from control_plane.domain.placements.rendezvous import unit_hash
from control_plane.domain.placements.replicas import AdapterPlacement, EngineLoad

MIN_GAP = 2  # free capacity between the two engines; a move shrinks the gap by two
REL_GAP = 0.25  # ... or this share of what an engine holds on average, whichever is more


@dataclass(frozen=True)
class Move:
    adapter_id: int
    source: int  # engine ids
    target: int


def gap(engines: Iterable[EngineLoad]) -> int:
    """How much more free capacity than the average a target needs, and than its source."""
    held = [e.pinned + e.loaded for e in engines if e.healthy]
    return max(MIN_GAP, math.ceil(REL_GAP * sum(held) / len(held))) if held else MIN_GAP


def plan_moves(adapters: Iterable[AdapterPlacement], engines: dict[int, EngineLoad], budget: int,
               busy: set[int]) -> list[Move]:
    """Up to `budget` moves; `busy` adapters (moving or changed this pass) are left alone. The engines'
    loads are updated as if the moves had happened."""
    if budget <= 0:
        return []
    on_engine: dict[int, list[AdapterPlacement]] = {}
    for adapter in adapters:
        if adapter.id in busy or adapter.pinned:
            continue
        for engine_id in adapter.serving(engines):
            on_engine.setdefault(engine_id, []).append(adapter)
    moves: list[Move] = []
    search = _Search(on_engine)
    while len(moves) < budget:
        move = search.best_move(engines)
        if move is None:
            break
        moves.append(move)
        search.moved.add(move.adapter_id)
        engines[move.source].loaded -= 1
        engines[move.target].loaded += 1
    return moves


class _Search:
    """One pass's search for moves, with what it hashed kept: at rest a pass scans every pair of engines
    whose gap is wide enough, and the same pairs again for each move of the budget."""

    def __init__(self, on_engine: dict[int, list[AdapterPlacement]]) -> None:
        self.on_engine = on_engine
        self.moved: set[int] = set()
        self._hashes: dict[tuple[str, str], float] = {}
        self._matching: dict[int, frozenset[int]] = {}  # by id() of the list: a pass shares one per base model

    def _u(self, adapter: str, engine: str) -> float:
        u = self._hashes.get((adapter, engine))
        if u is None:
            u = self._hashes[(adapter, engine)] = unit_hash(adapter, engine)
        return u

    def _matches(self, matching: Sequence[int], engine_id: int) -> bool:
        found = self._matching.get(id(matching))
        if found is None:
            found = self._matching[id(matching)] = frozenset(matching)
        return engine_id in found

    def best_move(self, engines: dict[int, EngineLoad]) -> Move | None:
        healthy = sorted((e for e in engines.values() if e.healthy), key=lambda e: (e.free, e.name))
        if not healthy:
            return None
        least = gap(healthy)
        floor = sum(e.free for e in healthy) / len(healthy) + least  # a target holds much less than the average
        for target in reversed(healthy):  # the emptiest first
            if target.free < floor:
                break
            for source in healthy:  # the fullest first
                if target.free - source.free < least:
                    break
                best: tuple[float, AdapterPlacement] | None = None
                for adapter in self.on_engine.get(source.id, ()):
                    if (adapter.id in self.moved or not target.takes(adapter.rank)
                            or not self._matches(adapter.matching, target.id)
                            or any(h.engine_id == target.id for h in adapter.holders)):
                        continue
                    u = self._u(adapter.name, target.name)
                    if u <= self._u(adapter.name, source.name):
                        continue  # it prefers where it is: the next pass would want it back
                    if best is None or u > best[0]:  # the highest u ranks the target highest (equal weights)
                        best = (u, adapter)
                if best is not None:
                    return Move(best[1].id, source.id, target.id)
        return None
