"""Bounded rebalancing, pure: which placements to move onto engines that hold much less than others.

An engine that returns (or joins) holds nothing, while the adapters it held were re-placed elsewhere.
Each fleet pass moves at most `budget` placements (`--rebalance-max-moves`, counting moves still under
way) from the fullest engine to the emptiest one, and only while their free capacity differs by two or
more: after a move the difference has shrunk, so a move never calls for its reverse and the passes come
to rest. The adapter moved is the one on the full engine that ranks the empty engine highest in
rendezvous order (by the names' hash alone), so a returning engine gets back the adapters that hash to
it, as when it left.

A move is make-before-break: the new placement is added, the old one marked leaving and released by a
later pass only once the adapter has its desired replicas observed loaded (replicas.releasable), so it
never has fewer than `min` replicas loaded. Pinned adapters and adapters that are already moving or
being re-placed stay where they are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from control_plane.domain.placements.rendezvous import unit_hash
from control_plane.domain.placements.replicas import AdapterPlacement, EngineLoad

MIN_GAP = 2  # free capacity between the two engines; a move shrinks the gap by two


@dataclass(frozen=True)
class Move:
    adapter_id: int
    source: int  # engine ids
    target: int


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
    moved: set[int] = set()
    while len(moves) < budget:
        move = _best_move(on_engine, engines, moved)
        if move is None:
            break
        moves.append(move)
        moved.add(move.adapter_id)
        engines[move.source].loaded -= 1
        engines[move.target].loaded += 1
    return moves


def _best_move(on_engine: dict[int, list[AdapterPlacement]], engines: dict[int, EngineLoad],
               moved: set[int]) -> Move | None:
    healthy = sorted((e for e in engines.values() if e.healthy), key=lambda e: (e.free, e.name))
    for target in reversed(healthy):  # the emptiest first
        for source in healthy:  # the fullest first
            if target.free - source.free < MIN_GAP:
                break
            best: tuple[float, AdapterPlacement] | None = None
            for adapter in on_engine.get(source.id, ()):
                if adapter.id in moved or target.id not in adapter.matching or not target.takes(adapter.rank):
                    continue
                if any(h.engine_id == target.id for h in adapter.holders):
                    continue
                u = unit_hash(adapter.name, target.name)
                if best is None or u > best[0]:  # the highest u ranks the target highest (equal weights)
                    best = (u, adapter)
            if best is not None:
                return Move(best[1].id, source.id, target.id)
    return None
