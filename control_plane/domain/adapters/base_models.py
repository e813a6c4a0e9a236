"""An adapter's base model: the names it may not take, and re-targeting it (PATCH `base_model`).

Re-targeting changes which engines may hold the adapter: its placements on engines that do not serve the
new base model are desired absent (those engines told to unload; the rows are removed once an engine
answered), and the active version is placed on engines of the new base model as a load places it, pinned
when it was pinned. An adapter that was unloaded, or has no active version, keeps only its new base model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import delete, select
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
from control_plane.domain.engines.matching import serves_base_model
from control_plane.domain.placements import view
from control_plane.domain.placements.planner import PlacementPlanner, PushOrder, lock_placements, of_adapter
from shared.errors import InvalidRequestError


async def refuse_base_model_names(session: AsyncSession, adapter: Adapter) -> None:
    """An adapter may not be named like its base model or like any base model an engine serves: engines
    answer that `model` with the base itself, so such an adapter would be recorded and then fail on every
    engine forever."""
    served = await session.scalar(select(Engine.name).where(Engine.base_model == adapter.name).limit(1))
    if adapter.name == adapter.base_model or served is not None:
        raise InvalidRequestError(
            f"lora_name {adapter.name!r} is the name of a base model"
            + (f" (engine {served!r} serves it)" if served is not None else "")
            + "; engines answer that model name with the base model, so choose another adapter name",
            param="lora_name")


@dataclass
class Retarget:
    """What a re-target did: the base models before and after, the orders for the engines, and the
    placements released (removed once their engines answered the unload)."""

    old: str
    new: str
    orders: list[PushOrder] = field(default_factory=list)
    released: list[int] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return self.old != self.new


async def retarget(session: AsyncSession, planner: PlacementPlanner, adapter: Adapter, base_model: str) -> Retarget:
    """Set `adapter`'s base model (its row locked by the caller), release its placements on engines that do
    not serve it and place its active version on engines that do (see the module doc)."""
    done = Retarget(old=adapter.base_model, new=base_model)
    if not done.changed:
        return done
    adapter.base_model = base_model
    await refuse_base_model_names(session, adapter)
    await lock_placements(session, of_adapter(adapter.id))
    held = (await session.execute(
        select(Placement.id, Placement.desired, serves_base_model(base_model))
        .join(Engine, Engine.id == Placement.engine_id)
        .join(AdapterVersion, AdapterVersion.id == Placement.adapter_version_id)
        .where(AdapterVersion.adapter_id == adapter.id, Placement.desired.in_(HOLDING)))).all()
    pinned = any(desired == DesiredState.PINNED.value for _, desired, _ in held)
    done.released = [pid for pid, _, serves in held if not serves]
    done.orders = await planner.release(session, adapter, done.released)
    if adapter.active_version_id is not None and not view.unloaded(adapter):
        version = await session.get_one(AdapterVersion, adapter.active_version_id)
        mode = DesiredState.PINNED if pinned else DesiredState.LOADED
        done.orders += await planner.place(session, adapter, version, mode, None)
    return done


async def forget_released(session: AsyncSession, placement_ids: list[int]) -> None:
    """Remove the released placements whose engines unloaded them (still desired absent: no call since
    desired them again); the others stay for the reconciler to unload."""
    if placement_ids:
        await session.execute(delete(Placement).where(
            Placement.id.in_(placement_ids), Placement.desired == DesiredState.ABSENT.value,
            Placement.observed == ObservedState.ABSENT.value))

