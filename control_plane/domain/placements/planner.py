"""PlacementPlanner: the seam between the registry and the engines — which engine should hold what.

It records desired state on `placements` rows, inside the caller's transaction, and returns one
PushOrder per engine; after the commit, control_plane.domain.placements.push carries them out. The
reconciler that reads `desired` vs `observed` later starts from the same rows.

Lock order (PostgreSQL): every writer of placement rows takes them in one order, ascending id, before it
changes any (`lock_placements`): the planner's callers all the adapter's rows, the pusher the rows it
records, the reconciler one engine's rows. Writers that also lock an engine or adapter row take that one
first. Without this a reconcile on one replica and a push recorded on another deadlocked (each held a
row the other was about to update).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sqlalchemy import ColumnElement, exists, select, update
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
from control_plane.domain.placements.loads import RecordedVersion
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


def in_store(version_id: ColumnElement[int] | int) -> ColumnElement[bool]:
    """Whether the version's files are in the artifact store (it has a manifest)."""
    return exists().where(VersionFile.adapter_version_id == version_id)


async def recorded_version(session: AsyncSession, version: AdapterVersion) -> RecordedVersion:
    stored = bool(await session.scalar(select(in_store(version.id))))
    return RecordedVersion(sha256=version.sha256, uri=version.uri, in_store=stored, size_bytes=version.size_bytes)


def of_adapter(adapter_id: int) -> ColumnElement[bool]:
    return Placement.adapter_version_id.in_(select(AdapterVersion.id).where(AdapterVersion.adapter_id == adapter_id))


class PlacementPlanner:
    def __init__(self, stale_after_s: float = 30.0) -> None:
        self.stale_after_s = stale_after_s

    async def place(
        self, session: AsyncSession, adapter: Adapter, version: AdapterVersion, desired: DesiredState,
        engine_names: list[str] | None,
    ) -> list[PushOrder]:
        """Desire `version` on every healthy engine of the adapter's base model (or the named ones);
        the adapter's other versions on those engines are desired absent (the switch)."""
        engines = await self._engines(session, adapter.base_model, engine_names)
        await lock_placements(session, of_adapter(adapter.id))
        return [await self._set(session, adapter, version, engine, desired) for engine in engines]

    async def ensure_placed(self, session: AsyncSession, adapter: Adapter) -> list[PushOrder]:
        """A router has requests for `adapter` and nobody holds it: desire its active version where the
        replica rules put it (for now: every healthy engine of its base model, when no engine holds it)."""
        if adapter.active_version_id is None:
            return []
        await lock_placements(session, of_adapter(adapter.id))
        held = await session.scalar(select(Placement.id).where(
            of_adapter(adapter.id), Placement.desired.in_(HOLDING)).limit(1))
        if held is not None:
            return []
        version = await session.get_one(AdapterVersion, adapter.active_version_id)
        return await self.place(session, adapter, version, DesiredState.LOADED, None)

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
        return [await self._set(session, adapter, version, engine, DesiredState(desired))
                for engine, desired in best.values()]

    async def withdraw(self, session: AsyncSession, adapter: Adapter) -> list[PushOrder]:
        """Desire every version of the adapter absent everywhere (unload); one order per engine."""
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
                                                           Engine.base_model == adapter.base_model))
        if engine is None:
            return
        await lock_placements(session, of_adapter(adapter.id))
        held = await session.scalar(select(Placement).where(
            Placement.engine_id == engine.id, Placement.adapter_version_id == version.id,
            Placement.desired.in_(HOLDING)))
        if held is None:
            await self._set(session, adapter, version, engine, DesiredState.LOADED)
            await session.execute(update(Placement).where(
                Placement.engine_id == engine.id, Placement.adapter_version_id == version.id,
            ).values(observed=ObservedState.LOADING.value, last_error=None))

    async def _engines(self, session: AsyncSession, base_model: str, names: list[str] | None) -> list[Engine]:
        if names is None:
            stmt = select(Engine).where(Engine.base_model == base_model, healthy_clause(self.stale_after_s))
            return list((await session.scalars(stmt.order_by(Engine.name))).all())
        engines = list((await session.scalars(select(Engine).where(Engine.name.in_(names)))).all())
        unknown = sorted(set(names) - {e.name for e in engines})
        if unknown:
            raise InvalidRequestError(f"unknown engine(s): {', '.join(unknown)}", param="engines")
        wrong = [e.name for e in engines if e.base_model != base_model]
        if wrong:
            raise InvalidRequestError(f"engine(s) {', '.join(wrong)} serve another base model than "
                                      f"{base_model!r}", param="engines")
        return sorted(engines, key=lambda e: e.name)

    async def _set(self, session: AsyncSession, adapter: Adapter, version: AdapterVersion, engine: Engine,
                   desired: DesiredState) -> PushOrder:
        await session.execute(
            update(Placement).where(
                Placement.engine_id == engine.id, Placement.adapter_version_id != version.id,
                Placement.adapter_version_id.in_(select(AdapterVersion.id).where(AdapterVersion.adapter_id == adapter.id)),
            ).values(desired=DesiredState.ABSENT.value)
        )
        placement = await session.scalar(select(Placement).where(
            Placement.engine_id == engine.id, Placement.adapter_version_id == version.id))
        if placement is None:
            placement = Placement(engine_id=engine.id, adapter_version_id=version.id)
            session.add(placement)
        placement.desired = desired.value
        await session.flush()
        return PushOrder(engine_id=engine.id, engine=engine.name, url=engine.url, adapter=adapter.name,
                         action="load", desired=placement.desired, placement_ids=(placement.id,),
                         recorded=await recorded_version(session, version), adapter_id=adapter.id,
                         version=version.number)
