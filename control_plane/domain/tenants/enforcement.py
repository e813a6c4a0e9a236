"""Whether tenancy holds anywhere: a tenant's private adapters and quotas are applied by the routers that
require API keys (--require-api-key), and by no other. Routers report it with their presence
(control_plane/domain/routers); the control plane's /health, the console's Fleet page and the answers of
tenancy changes say it."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.db.models import RouterInstance
from control_plane.db.models.router import ROUTER_STALE_AFTER_S

NOT_ENFORCED = (f"no router that reported within the last {ROUTER_STALE_AFTER_S:.0f} s requires API keys, so "
                "every client is still served every adapter, private ones included, and no quota applies; start "
                "the routers with --require-api-key (loraplane up --require-api-key)")


async def enforcing_routers(session: AsyncSession) -> list[str]:
    """The routers up now (reported within ROUTER_STALE_AFTER_S) that refuse clients without a key, by
    name (inside the caller's transaction or read)."""
    since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=ROUTER_STALE_AFTER_S)
    return list((await session.scalars(select(RouterInstance.name).where(
        RouterInstance.require_api_key.is_(True), RouterInstance.last_seen_at >= since)
        .order_by(RouterInstance.name))).all())


async def tenancy_warnings(session: AsyncSession) -> list[str]:
    """What a tenancy change (an adapter made private, a quota set) answers beside its result: a warning
    when no router enforces tenant keys, as the change then reaches no client."""
    return [] if await enforcing_routers(session) else [NOT_ENFORCED]
