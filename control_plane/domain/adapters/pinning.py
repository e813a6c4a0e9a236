"""Pin or unpin an adapter where it is held: PATCH /v1/lora_adapters/{name} `{pinned}`.

Pinned is a desired state of placements (DesiredState.PINNED: loaded and never evicted from the engine's
device slots), so pinning rewrites the desired state of every placement that holds the adapter, and the
healthy engines among them are told at once by a load of the same version with the new `pinned` (the
engine re-declares an adapter it holds with the same digest in place: no reload). Replicas added later
follow the holders (planner.add: new replicas of a pinned adapter are pinned). An unhealthy holder keeps
the new desired state and gets it from the reconciler when it is back.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.db.models import HOLDING, Adapter, AdapterVersion, DesiredState, Engine, Placement
from control_plane.domain.engines.health import healthy_clause
from control_plane.domain.placements.planner import PlacementPlanner, PushOrder, lock_placements, of_adapter
from shared.errors import ConflictError


async def set_pinned(session: AsyncSession, planner: PlacementPlanner, adapter: Adapter,
                     pinned: bool) -> list[PushOrder]:
    """Every placement holding `adapter` desired pinned (or loaded); one load order per healthy engine.
    409 when no engine is to hold it: there is nothing the pin could be recorded on."""
    await lock_placements(session, of_adapter(adapter.id))
    rows = (await session.execute(
        select(Engine, AdapterVersion, healthy_clause(planner.stale_after_s))
        .join(Placement, Placement.engine_id == Engine.id)
        .join(AdapterVersion, AdapterVersion.id == Placement.adapter_version_id)
        .where(AdapterVersion.adapter_id == adapter.id, Placement.desired.in_(HOLDING))
        .order_by(Engine.name)
    )).all()
    if not rows:
        raise ConflictError(f"no engine is to hold adapter {adapter.name!r}, so there is nothing to "
                            f"{'pin' if pinned else 'unpin'}; load it (with pinned true to pin it)", param="pinned")
    mode = DesiredState.PINNED if pinned else DesiredState.LOADED
    orders = []
    for engine, version, healthy in rows:
        order = await planner.desire(session, adapter, version, engine, mode)
        if healthy:
            orders.append(order)
    return orders


def last_per_engine(orders: list[PushOrder]) -> list[PushOrder]:
    """One order per engine, the last one given (a PATCH of replicas and pinned may order one engine
    twice, and the pusher calls the engines concurrently)."""
    return list({order.engine_id: order for order in orders}.values())
