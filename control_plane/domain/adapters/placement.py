"""PlacementPlanner: the seam between the registry and the engines — which engine should hold what.

It only records desired state on `placements` rows, inside the caller's transaction. Pushing to the
engines (httpx) and the reconciler that reads `desired` vs `observed` come later and start from here.
"""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.db.models import Adapter, AdapterVersion, DesiredState, Engine, EngineState, Placement
from control_plane.domain.adapters.schemas import EngineOutcome
from shared.errors import InvalidRequestError

_HOLDING = (DesiredState.LOADED.value, DesiredState.PINNED.value)


class PlacementPlanner:
    async def place(
        self, session: AsyncSession, adapter: Adapter, version: AdapterVersion, desired: DesiredState,
        engine_names: list[str] | None,
    ) -> list[EngineOutcome]:
        """Desire `version` on every healthy engine of the adapter's base model (or the named ones);
        the adapter's other versions on those engines are desired absent (the switch)."""
        engines = await self._engines(session, adapter.base_model, engine_names)
        return [await self._set(session, adapter, version, engine, desired) for engine in engines]

    async def switch(self, session: AsyncSession, adapter: Adapter, version: AdapterVersion) -> list[EngineOutcome]:
        """After activation: every engine holding some version of the adapter is to hold `version`,
        with the same desired state (loaded or pinned) it had."""
        rows = (await session.execute(
            select(Engine, Placement.desired).join(Placement, Placement.engine_id == Engine.id)
            .join(AdapterVersion, AdapterVersion.id == Placement.adapter_version_id)
            .where(AdapterVersion.adapter_id == adapter.id, Placement.desired.in_(_HOLDING))
        )).all()
        best: dict[int, tuple[Engine, str]] = {}
        for engine, desired in rows:  # pinned wins over loaded when an engine held two versions
            if engine.id not in best or desired == DesiredState.PINNED.value:
                best[engine.id] = (engine, desired)
        return [await self._set(session, adapter, version, engine, DesiredState(desired))
                for engine, desired in best.values()]

    async def withdraw(self, session: AsyncSession, adapter: Adapter) -> list[EngineOutcome]:
        """Desire every version of the adapter absent everywhere (unload)."""
        rows = (await session.execute(
            select(Placement, Engine.name).join(Engine, Engine.id == Placement.engine_id)
            .join(AdapterVersion, AdapterVersion.id == Placement.adapter_version_id)
            .where(AdapterVersion.adapter_id == adapter.id, Placement.desired.in_(_HOLDING))
        )).all()
        for placement, _ in rows:
            placement.desired = DesiredState.ABSENT.value
        await session.flush()
        return [EngineOutcome(engine=name, desired=p.desired, observed=p.observed, error=p.last_error)
                for p, name in rows]

    async def _engines(self, session: AsyncSession, base_model: str, names: list[str] | None) -> list[Engine]:
        if names is None:
            stmt = select(Engine).where(Engine.base_model == base_model, Engine.state == EngineState.HEALTHY.value)
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
                   desired: DesiredState) -> EngineOutcome:
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
        return EngineOutcome(engine=engine.name, desired=placement.desired, observed=placement.observed,
                             error=placement.last_error)
