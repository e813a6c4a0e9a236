"""Reading the rows placement decides on into the pure shapes of replicas.py (no writes, no locks).

The planner reads one adapter (`adapter_placement`); the fleet pass reads them all (`active_adapters`,
`holders`, `engine_loads`).
Engine loads count the placements desired held on each engine; `leaving` placements (rebalancing moves'
sources, listed in their adapter's scale_state) are left out of the counts, as they are about to go.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, SQLColumnExpression, case, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.db.models import (
    HOLDING,
    Adapter,
    AdapterVersion,
    DesiredState,
    Engine,
    ObservedState,
    Placement,
)
from control_plane.domain.engines.health import healthy_clause
from control_plane.domain.engines.matching import serves_base_model
from control_plane.domain.placements.replicas import (
    AdapterPlacement,
    EngineLoad,
    Holder,
    ReplicaDefaults,
    ReplicaRule,
)

LEAVING = "leaving"  # scale_state key: ids of placements that are a move's source
UNLOADED = "unloaded"  # scale_state key: true after an unload, until a load


MAX_LISTED = 10_000  # ids named in one IN (…): asyncpg sends at most 32,767 bound parameters a statement


def among(column: SQLColumnExpression[int], ids: Collection[int]) -> ColumnElement[bool]:
    """`column` in `ids`; more than MAX_LISTED ids (a pass placing 100,000 new adapters) as the range they
    span instead, a superset: callers lock or read a few rows more than they asked for, never fewer."""
    ids = list(ids)
    return column.in_(ids) if len(ids) <= MAX_LISTED else column.between(min(ids), max(ids))


def of_adapters(adapter_ids: Collection[int]) -> ColumnElement[bool]:
    """The placements of these adapters (any version; for very many, of every adapter in their range)."""
    return Placement.adapter_version_id.in_(
        select(AdapterVersion.id).where(among(AdapterVersion.adapter_id, adapter_ids)))


def leaving_ids(scale_state: dict[str, Any] | None) -> set[int]:
    return {int(i) for i in (scale_state or {}).get(LEAVING, ())}


async def engine_loads(session: AsyncSession, stale_after_s: float, leaving: Collection[int] = ()) -> dict[int, EngineLoad]:
    """Every registered engine with its health and what it is desired to hold."""
    rows = (await session.execute(select(Engine, healthy_clause(stale_after_s).label("healthy")))).all()
    loads = {e.id: EngineLoad(id=e.id, name=e.name, healthy=bool(healthy), slots=e.slots_total,
                              host_slots=e.max_cpu_loras, cache_bytes_free=e.cache_bytes_free,
                              max_lora_rank=e.max_lora_rank) for e, healthy in rows}
    pinned = case((Placement.desired == DesiredState.PINNED.value, 1), else_=0)
    counts = select(Placement.engine_id, func.sum(pinned), func.count()).where(Placement.desired.in_(HOLDING))
    if leaving:
        counts = counts.where(Placement.id.not_in(list(leaving)))
    for engine_id, n_pinned, n in (await session.execute(counts.group_by(Placement.engine_id))).all():
        if engine_id in loads:
            loads[engine_id].pinned = int(n_pinned or 0)
            loads[engine_id].loaded = int(n) - int(n_pinned or 0)
    return loads


async def matching_engines(session: AsyncSession, base_models: Iterable[str]) -> dict[str, list[int]]:
    """Base model -> ids of the engines serving it (by any name they registered), ascending."""
    out: dict[str, list[int]] = {}
    for base in set(base_models):
        out[base] = list((await session.scalars(select(Engine.id).where(serves_base_model(base))
                                                .order_by(Engine.id))).all())
    return out


async def holders(session: AsyncSession, adapter_ids: Collection[int] | None = None) -> dict[int, list[Holder]]:
    """Adapter id -> its placements desired held (any version), ascending id (for very many `adapter_ids`,
    also those of the other adapters in their range: see `among`)."""
    stmt = (select(Placement.id, Placement.engine_id, Placement.desired, Placement.observed, AdapterVersion.adapter_id)
            .join(AdapterVersion, AdapterVersion.id == Placement.adapter_version_id)
            .where(Placement.desired.in_(HOLDING)).order_by(Placement.id))
    if adapter_ids is not None:
        stmt = stmt.where(among(AdapterVersion.adapter_id, adapter_ids))
    out: dict[int, list[Holder]] = {}
    for pid, engine_id, desired, observed, adapter_id in (await session.execute(stmt)).all():
        out.setdefault(adapter_id, []).append(Holder(pid, engine_id, desired == DesiredState.PINNED.value,
                                                     observed == ObservedState.LOADED.value))
    return out


@dataclass(frozen=True, slots=True)
class ActiveRow:
    """An adapter with an active version as the fleet pass's unlocked read sees it: the columns placement
    decides on, not ORM objects (building those at fleet scale is a large part of a steady pass:
    docs/performance.md#control-plane). It
    stands for both the adapter and its version where placement_of takes them."""

    id: int
    name: str
    base_model: str
    scale_state: dict[str, Any] | None
    min_replicas: int | None
    max_replicas: int | None
    target_replicas: int | None
    size_bytes: int
    rank: int


def placement_of(adapter: Adapter | ActiveRow, version: AdapterVersion | ActiveRow | None, matching: list[int],
                 held: list[Holder], defaults: ReplicaDefaults) -> AdapterPlacement:
    leaving = leaving_ids(adapter.scale_state)
    return AdapterPlacement(
        id=adapter.id, name=adapter.name,
        rule=ReplicaRule.of(adapter.min_replicas, adapter.max_replicas, adapter.target_replicas, defaults),
        matching=matching,
        holders=[Holder(h.placement_id, h.engine_id, h.pinned, h.loaded, h.placement_id in leaving) for h in held],
        size_bytes=version.size_bytes if version is not None else 0, rank=version.rank if version is not None else 0)


async def adapter_placement(session: AsyncSession, adapter: Adapter, version: AdapterVersion | None,
                            defaults: ReplicaDefaults) -> AdapterPlacement:
    matching = (await matching_engines(session, [adapter.base_model]))[adapter.base_model]
    held = (await holders(session, [adapter.id])).get(adapter.id, [])
    return placement_of(adapter, version, matching, held, defaults)


def unloaded(adapter: Adapter | ActiveRow) -> bool:
    """The adapter was unloaded (planner.withdraw): placement leaves it be and engines may not pull it,
    until a load places it again. A flag, not "has placements and none held": an adapter whose
    engines were all replaced and then deleted is in that state too, and must be placed again."""
    return bool((adapter.scale_state or {}).get(UNLOADED))


def mark_unloaded(adapter: Adapter, value: bool) -> None:
    state = {k: v for k, v in (adapter.scale_state or {}).items() if k != UNLOADED}
    if value:
        state[UNLOADED] = True
    adapter.scale_state = state or None


async def active_rows(session: AsyncSession) -> list[ActiveRow]:
    """Every adapter with an active version, ascending id (the order the fleet pass decides in)."""
    stmt = (select(Adapter.id, Adapter.name, Adapter.base_model, Adapter.scale_state, Adapter.min_replicas,
                   Adapter.max_replicas, Adapter.target_replicas, AdapterVersion.size_bytes, AdapterVersion.rank)
            .join(AdapterVersion, AdapterVersion.id == Adapter.active_version_id).order_by(Adapter.id))
    return [ActiveRow(*row) for row in (await session.execute(stmt)).all()]


async def active_adapters(session: AsyncSession, adapter_ids: Collection[int]) -> dict[int, tuple[Adapter, AdapterVersion]]:
    """These adapters with their active version, as ORM objects (the ones a pass changes, read under its
    locks); an adapter no longer active is left out."""
    wanted = set(adapter_ids)
    stmt = (select(Adapter, AdapterVersion).join(AdapterVersion, AdapterVersion.id == Adapter.active_version_id)
            .where(among(Adapter.id, wanted)).order_by(Adapter.id))
    return {a.id: (a, v) for a, v in (await session.execute(stmt)).all() if a.id in wanted}
