"""Router presence: each demand report that names its router replaces that router's row.

A router reports at least every few seconds (data_plane/router/demand.py: `presence_interval_s`), so one
silent for STALE_AFTER_S is shown stale; rows silent for FORGET_AFTER are deleted when another report
comes, which keeps the table to the routers that exist (a restarted router on another port is a new
name; the old one ages out).
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.db.models import RouterInstance
from control_plane.db.models.router import ROUTER_STALE_AFTER_S
from control_plane.db.transaction import read
from control_plane.domain.engines.health import now
from control_plane.domain.routers import schemas
from shared.routes import RouterPresence

STALE_AFTER_S = ROUTER_STALE_AFTER_S
FORGET_AFTER = dt.timedelta(days=1)


async def record_presence(session: AsyncSession, presence: RouterPresence, token_id: str) -> None:
    """Upsert the router's row (inside the caller's transaction); forget routers silent for a day."""
    at = now()
    await session.execute(delete(RouterInstance).where(RouterInstance.last_seen_at < at - FORGET_AFTER))
    row = await session.scalar(select(RouterInstance).where(RouterInstance.name == presence.name))
    if row is None:
        row = RouterInstance(name=presence.name, first_seen_at=at)
        session.add(row)
    row.token_id, row.url, row.last_seen_at = token_id, presence.url, at
    row.running, row.waiting, row.table_age_s = presence.running, presence.waiting, presence.table_age_s
    row.require_api_key = presence.require_api_key
    await session.flush()


def _state(last_seen: dt.datetime, at: dt.datetime) -> str:
    seen = last_seen.replace(tzinfo=last_seen.tzinfo or dt.UTC)
    return "up" if (at - seen).total_seconds() <= STALE_AFTER_S else "stale"


async def list_routers(session: AsyncSession) -> schemas.RouterList:
    async def rows() -> schemas.RouterList:
        at = now()
        found = (await session.scalars(select(RouterInstance).order_by(RouterInstance.name))).all()
        return schemas.RouterList(stale_after_s=STALE_AFTER_S, data=[schemas.Router(
            name=r.name, url=r.url, state=_state(r.last_seen_at, at), running=r.running, waiting=r.waiting,
            table_age_s=r.table_age_s, require_api_key=r.require_api_key, first_seen_at=r.first_seen_at,
            last_seen_at=r.last_seen_at)
            for r in found])

    return await read(session, rows, "routers")

