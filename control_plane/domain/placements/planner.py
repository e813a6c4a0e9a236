"""PlacementPlanner: the seam between the registry and the engines — which engine should hold what.

It records desired state on `placements` rows, inside the caller's transaction, and returns one
PushOrder per engine; after the commit, control_plane.domain.placements.push carries them out. The
reconciler that reads `desired` vs `observed` later starts from the same rows, and its fleet pass
(domain/placements/fleet.py) keeps every adapter at its replica count between admin calls.

Replica rules (domain/placements/replicas.py): an adapter is held by `desired` = clamp(target or min, min,
max or all) healthy engines of its base model (matched by any name an engine registered,
domain/engines/matching.py) that can load its rank. A load or upload without `engines` keeps the
adapter where it is held (switching those engines to the new version) and adds engines, chosen by
weighted rendezvous hashing over free capacity (domain/placements/rendezvous.py), until `desired`
healthy ones hold it; with `engines` it goes exactly there. A router asking for an adapter nobody
holds (`ensure_placed`) gets at least one replica; a PATCH of `replicas` (`resize`) adds or lets go of
replicas at once. An adapter that was unloaded (view.unloaded) is never placed again by these rules:
only a load does that.

Lock order (PostgreSQL): every writer of placement rows takes them in one order, ascending id, before it
changes any (`lock_placements`): the planner's callers all the adapter's rows, the pusher the rows it
records, the reconciler one engine's rows, the fleet pass the rows of the adapters it changes. Writers
that also lock an engine or adapter row take that one first (adapters before engines, each kind in
ascending id): admin calls lock their adapter row, the reconciler its engine row, the fleet pass the
adapter rows it changes and then the engine rows it adds placements on. Without this a reconcile on one
replica and a push recorded on another deadlocked (each held a row the other was about to update).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sqlalchemy import ColumnElement, SQLColumnExpression, exists, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.db.models import (
    HOLDING,
    Adapter,
    AdapterVersion,
    DesiredState,
    Engine,
    ObservedState,
    Placement,
    VersionFile,
)
from control_plane.domain.engines.health import healthy_clause
from control_plane.domain.engines.matching import serves_base_model
from control_plane.domain.placements import view
from control_plane.domain.placements.desired import Held, desire_absent, desire_held
from control_plane.domain.placements.loads import RecordedVersion
from control_plane.domain.placements.replicas import (
    AdapterPlacement,
    EngineLoad,
    ReplicaDefaults,
    fill,
    releasable,
)
from control_plane.settings import ControlPlaneSettings
from shared.errors import InvalidRequestError


@dataclass(frozen=True)
class PushOrder:
    """What one engine is to be told about one adapter, and which placement rows record its answer."""

    engine_id: int
    engine: str
    url: str
    adapter: str
    action: Literal["load", "unload"]
    desired: str
    placement_ids: tuple[int, ...]
    recorded: RecordedVersion | None = None  # load: what to load (digest, and where its bytes are)
    adapter_id: int | None = None  # load: the other versions on the engine are then observed absent
    version: int | None = None  # load: the version's number (named in errors)


async def lock_placements(session: AsyncSession, where: ColumnElement[bool]) -> None:
    """Lock the placement rows matching `where`, in ascending id (see the module doc). SQLite has no row
    locks (its writers are serialised by the write gate) and ignores FOR UPDATE."""
    await session.execute(select(Placement.id).where(where).order_by(Placement.id).with_for_update())


def in_store(version_id: SQLColumnExpression[int] | int) -> ColumnElement[bool]:
    """Whether the version's files are in the artifact store (it has a manifest)."""
    return exists().where(VersionFile.adapter_version_id == version_id)


async def recorded_version(session: AsyncSession, version: AdapterVersion) -> RecordedVersion:
    stored = bool(await session.scalar(select(in_store(version.id))))
    return RecordedVersion(sha256=version.sha256, uri=version.uri, in_store=stored, size_bytes=version.size_bytes,
                           number=version.number)


def replica_defaults(settings: ControlPlaneSettings) -> ReplicaDefaults:
    return ReplicaDefaults(settings.default_min_replicas, settings.default_max_replicas)


def of_adapter(adapter_id: int) -> ColumnElement[bool]:
    return Placement.adapter_version_id.in_(select(AdapterVersion.id).where(AdapterVersion.adapter_id == adapter_id))


class PlacementPlanner:
    def __init__(self, stale_after_s: float = 30.0, defaults: ReplicaDefaults | None = None) -> None:
        self.stale_after_s = stale_after_s
        self.defaults = defaults or ReplicaDefaults()

    @classmethod
    def of(cls, settings: ControlPlaneSettings) -> PlacementPlanner:
        return cls(settings.engine_stale_after_s, replica_defaults(settings))

    async def place(
        self, session: AsyncSession, adapter: Adapter, version: AdapterVersion, desired: DesiredState,
        engine_names: list[str] | None,
    ) -> list[PushOrder]:
        """Desire `version` on the named engines, or else where the replica rules put it: the engines
        holding the adapter now (healthy or not: one that returns must not serve the old version) and as
        many more as make `desired` healthy replicas. Orders go to the healthy ones; the adapter's other
        versions on those engines are desired absent (the switch). An unloaded adapter is placed again."""
        view.mark_unloaded(adapter, False)
        await lock_placements(session, of_adapter(adapter.id))
        if engine_names is not None:
            engines = await self._named(session, adapter.base_model, engine_names)
            return [await self.desire(session, adapter, version, engine, desired) for engine in engines]
        plan = await view.adapter_placement(session, adapter, version, self.defaults)
        loads = await view.engine_loads(session, self.stale_after_s, view.leaving_ids(adapter.scale_state))
        added = fill(plan, loads, plan.rule.desired(len(plan.able(loads))))
        targets = sorted({h.engine_id for h in plan.holders} | set(added))
        orders = []
        for engine in await self._by_id(session, targets):
            order = await self.desire(session, adapter, version, engine, desired)
            if loads[engine.id].healthy:
                orders.append(order)
        return orders

    async def ensure_placed(self, session: AsyncSession, adapter: Adapter) -> list[PushOrder]:
        """A router has requests for `adapter` and no healthy engine holds it: desire its active version
        where the replica rules put it (at least one replica, even for `min` 0). Nothing for an adapter
        without an active version or one that was unloaded."""
        current = await self._current(session, adapter)
        if current is None:
            return []
        version, plan, loads = current
        if plan.serving(loads):
            return []
        able = len(plan.able(loads))
        return await self.add(session, adapter, version, plan, fill(plan, loads, min(max(plan.rule.desired(able), 1), able)))

    async def resize(self, session: AsyncSession, adapter: Adapter) -> list[PushOrder]:
        """After `replicas` changed: add replicas up to the new desired count, or let go of the least
        useful ones above it (never a loaded one that would leave fewer than desired loaded)."""
        current = await self._current(session, adapter)
        if current is None:
            return []
        version, plan, loads = current
        desired = plan.rule.desired(len(plan.able(loads)))
        orders = await self.add(session, adapter, version, plan, fill(plan, loads, desired))
        return orders + await self.release(session, adapter, releasable(plan, loads, desired, keep=desired))

    async def _current(self, session: AsyncSession,
                       adapter: Adapter) -> tuple[AdapterVersion, AdapterPlacement, dict[int, EngineLoad]] | None:
        """The adapter's rows locked and read for the replica rules; None when they leave it alone (no
        active version, or unloaded)."""
        if adapter.active_version_id is None:
            return None
        await lock_placements(session, of_adapter(adapter.id))
        if view.unloaded(adapter):
            return None
        version = await session.get_one(AdapterVersion, adapter.active_version_id)
        plan = await view.adapter_placement(session, adapter, version, self.defaults)
        return version, plan, await view.engine_loads(session, self.stale_after_s, view.leaving_ids(adapter.scale_state))

    async def add(self, session: AsyncSession, adapter: Adapter, version: AdapterVersion, plan: AdapterPlacement,
                  engine_ids: list[int]) -> list[PushOrder]:
        """The active version desired on these engines, pinned where the adapter's replicas are (set-based:
        desired.desire_held)."""
        if not engine_ids:
            return []
        mode = DesiredState.PINNED if plan.pinned else DesiredState.LOADED
        ids = await desire_held(session, [Held(adapter.id, version.id, e, mode) for e in engine_ids])
        recorded = await recorded_version(session, version)
        return [_load_order(adapter, version, e, mode, ids[(e.id, version.id)], recorded)
                for e in await self._by_id(session, engine_ids)]

    async def release(self, session: AsyncSession, adapter: Adapter, placement_ids: list[int]) -> list[PushOrder]:
        """Desire these placements absent; one unload order per healthy engine that held them (rows
        already locked by the caller)."""
        if not placement_ids:
            return []
        rows = (await session.execute(
            select(Placement.id, Engine, healthy_clause(self.stale_after_s))
            .join(Engine, Engine.id == Placement.engine_id)
            .where(Placement.id.in_(placement_ids)).order_by(Engine.name, Placement.id))).all()
        by_engine: dict[int, tuple[Engine, bool, list[int]]] = {}
        for placement_id, engine, healthy in rows:
            by_engine.setdefault(engine.id, (engine, bool(healthy), []))[2].append(placement_id)
        await desire_absent(session, placement_ids)
        return [PushOrder(engine_id=e.id, engine=e.name, url=e.url, adapter=adapter.name, action="unload",
                          desired=DesiredState.ABSENT.value, placement_ids=tuple(ids))
                for e, healthy, ids in by_engine.values() if healthy]

    async def coverage(self, session: AsyncSession, base_model: str) -> tuple[int, int]:
        """How many registered engines serve `base_model`, and how many of them are healthy."""
        matching = (await view.matching_engines(session, [base_model]))[base_model]
        if not matching:
            return 0, 0
        healthy = await session.scalar(select(func.count()).select_from(Engine).where(
            Engine.id.in_(matching), healthy_clause(self.stale_after_s)))
        return len(matching), int(healthy or 0)

    async def switch(self, session: AsyncSession, adapter: Adapter, version: AdapterVersion) -> list[PushOrder]:
        """After activation: every engine holding some version of the adapter is to hold `version`,
        with the same desired state (loaded or pinned) it had."""
        await lock_placements(session, of_adapter(adapter.id))
        rows = (await session.execute(
            select(Engine, Placement.desired).join(Placement, Placement.engine_id == Engine.id)
            .join(AdapterVersion, AdapterVersion.id == Placement.adapter_version_id)
            .where(AdapterVersion.adapter_id == adapter.id, Placement.desired.in_(HOLDING))
        )).all()
        best: dict[int, tuple[Engine, str]] = {}
        for engine, desired in rows:  # pinned wins over loaded when an engine held two versions
            if engine.id not in best or desired == DesiredState.PINNED.value:
                best[engine.id] = (engine, desired)
        return [await self.desire(session, adapter, version, engine, DesiredState(desired))
                for engine, desired in best.values()]

    async def withdraw(self, session: AsyncSession, adapter: Adapter) -> list[PushOrder]:
        """Desire every version of the adapter absent everywhere (unload); one order per engine. The
        adapter is marked unloaded: the replica rules leave it be until a load."""
        view.mark_unloaded(adapter, True)
        await lock_placements(session, of_adapter(adapter.id))
        rows = (await session.execute(
            select(Placement, Engine).join(Engine, Engine.id == Placement.engine_id)
            .join(AdapterVersion, AdapterVersion.id == Placement.adapter_version_id)
            .where(AdapterVersion.adapter_id == adapter.id, Placement.desired.in_(HOLDING))
            .order_by(Engine.name)
        )).all()
        by_engine: dict[int, tuple[Engine, list[int]]] = {}
        for placement, engine in rows:
            placement.desired = DesiredState.ABSENT.value
            by_engine.setdefault(engine.id, (engine, []))[1].append(placement.id)
        await session.flush()
        return [PushOrder(engine_id=e.id, engine=e.name, url=e.url, adapter=adapter.name, action="unload",
                          desired=DesiredState.ABSENT.value, placement_ids=tuple(ids))
                for e, ids in by_engine.values()]

    async def adopt(self, session: AsyncSession, adapter: Adapter, version: AdapterVersion, engine_name: str) -> None:
        """An engine pulls `version` on demand: desire it there (loaded, unless already held), observed
        `loading` until the reconciler reads the engine. Unknown engines or another base model: nothing."""
        engine = await session.scalar(select(Engine).where(Engine.name == engine_name,
                                                           serves_base_model(adapter.base_model)))
        if engine is None:
            return
        await lock_placements(session, of_adapter(adapter.id))
        held = await session.scalar(select(Placement).where(
            Placement.engine_id == engine.id, Placement.adapter_version_id == version.id,
            Placement.desired.in_(HOLDING)))
        if held is None:
            await self.desire(session, adapter, version, engine, DesiredState.LOADED)
            await session.execute(update(Placement).where(
                Placement.engine_id == engine.id, Placement.adapter_version_id == version.id,
            ).values(observed=ObservedState.LOADING.value, last_error=None))

    async def _named(self, session: AsyncSession, base_model: str, names: list[str]) -> list[Engine]:
        """The engines named in a load's `engines` (health is not checked: the operator chose them)."""
        engines = list((await session.scalars(select(Engine).where(Engine.name.in_(names)))).all())
        unknown = sorted(set(names) - {e.name for e in engines})
        if unknown:
            raise InvalidRequestError(f"unknown engine(s): {', '.join(unknown)}", param="engines")
        serving = set((await session.scalars(select(Engine.id).where(
            Engine.name.in_(names), serves_base_model(base_model)))).all())
        wrong = sorted(e.name for e in engines if e.id not in serving)
        if wrong:
            raise InvalidRequestError(f"engine(s) {', '.join(wrong)} serve another base model than "
                                      f"{base_model!r}", param="engines")
        return sorted(engines, key=lambda e: e.name)

    async def _by_id(self, session: AsyncSession, ids: list[int]) -> list[Engine]:
        if not ids:
            return []
        return list((await session.scalars(select(Engine).where(Engine.id.in_(ids)).order_by(Engine.name))).all())

    async def desire(self, session: AsyncSession, adapter: Adapter, version: AdapterVersion, engine: Engine,
                     desired: DesiredState) -> PushOrder:
        """`version` desired on `engine` (its other versions there absent); the order that tells it."""
        ids = await desire_held(session, [Held(adapter.id, version.id, engine.id, desired)])
        return _load_order(adapter, version, engine, desired, ids[(engine.id, version.id)],
                           await recorded_version(session, version))


def _load_order(adapter: Adapter, version: AdapterVersion, engine: Engine, desired: DesiredState, placement_id: int,
                recorded: RecordedVersion) -> PushOrder:
    """The order that tells `engine` to hold `version` as `desired` (its placement row `placement_id`)."""
    return PushOrder(engine_id=engine.id, engine=engine.name, url=engine.url, adapter=adapter.name, action="load",
                     desired=desired.value, placement_ids=(placement_id,), recorded=recorded, adapter_id=adapter.id,
                     version=version.number)
