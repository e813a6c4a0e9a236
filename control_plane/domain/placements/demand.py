"""Demand figures per adapter, as engines and routers report them (demand_reports rows).

Each source keeps one row per adapter, replaced by its next report; demand scaling reads the rows fresher
than its window (`current_demand`). Sources are engines (`engine:<name>`, from the reconciler: requests
waiting and running there) and routers (`router:<token id>[:<name>]`: requests waiting for a placement,
and requests sent to an engine and not finished). A request a router sent is in both reports, so they are
not simply added (that would count it twice and scale up at half the configured load):

    waiting = routers' waiting (at no engine yet) + engines' waiting
    running = max(engines' running, routers' running - engines' waiting)

so waiting + running = routers' waiting + max(engines' waiting + running, routers' running): what the
engines hold, or what the routers have in flight when that is more (an engine's report lags a reconcile
interval, and direct clients add to the engines' figures only).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import delete, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.db.models import DemandReport
from control_plane.domain.engines.health import now

ENGINE_SOURCE = "engine:"  # + the engine's name: its queue, as the reconciler read it
ROUTER_SOURCE = "router:"  # + the token id[:router name]: a router's report (control_plane.domain.routes.service)


def engine_source(name: str) -> str:
    return f"{ENGINE_SOURCE}{name}"


@dataclass(frozen=True)
class AdapterDemand:
    adapter_id: int
    waiting: int
    running: int
    tokens_per_s: float = 0.0


async def record_demand(session: AsyncSession, source: str, figures: Iterable[AdapterDemand]) -> None:
    """Replace `source`'s rows for these adapters with the new figures (inside the caller's transaction)."""
    figures = list(figures)
    if not figures:
        return
    ids = [f.adapter_id for f in figures]
    await session.execute(delete(DemandReport).where(DemandReport.source == source,
                                                     DemandReport.adapter_id.in_(ids)))
    at = now()
    session.add_all(DemandReport(source=source, adapter_id=f.adapter_id, waiting=f.waiting, running=f.running,
                                 tokens_per_s=f.tokens_per_s, reported_at=at) for f in figures)
    await session.flush()


async def replace_demand(session: AsyncSession, source: str, figures: Iterable[AdapterDemand]) -> None:
    """`source`'s whole report: its rows replaced by these figures (those with any request; an adapter
    left out has none from this source)."""
    await session.execute(delete(DemandReport).where(DemandReport.source == source))
    busy = [f for f in figures if f.waiting or f.running or f.tokens_per_s]
    at = now()
    session.add_all(DemandReport(source=source, adapter_id=f.adapter_id, waiting=f.waiting, running=f.running,
                                 tokens_per_s=f.tokens_per_s, reported_at=at) for f in busy)
    await session.flush()


async def current_demand(session: AsyncSession, max_age_s: float) -> dict[int, AdapterDemand]:
    """Each adapter's demand from the figures reported within the last `max_age_s`, the engines' and the
    routers' combined as the module docstring says."""
    since = now() - dt.timedelta(seconds=max_age_s)
    from_router = DemandReport.source.startswith(ROUTER_SOURCE).label("from_router")
    rows = (await session.execute(
        select(DemandReport.adapter_id, from_router, func.sum(DemandReport.waiting), func.sum(DemandReport.running),
               func.sum(DemandReport.tokens_per_s))
        .where(DemandReport.reported_at >= since).group_by(DemandReport.adapter_id, from_router)
    )).all()
    engines: dict[int, tuple[int, int, float]] = {}
    routers: dict[int, tuple[int, int]] = {}
    for adapter_id, router, waiting, running, tokens_per_s in rows:
        if router:
            routers[adapter_id] = (int(waiting or 0), int(running or 0))
        else:
            engines[adapter_id] = (int(waiting or 0), int(running or 0), float(tokens_per_s or 0.0))
    out: dict[int, AdapterDemand] = {}
    for adapter_id in engines.keys() | routers.keys():
        engine_waiting, engine_running, tokens_per_s = engines.get(adapter_id, (0, 0, 0.0))
        router_waiting, router_running = routers.get(adapter_id, (0, 0))
        out[adapter_id] = AdapterDemand(adapter_id, router_waiting + engine_waiting,
                                        max(engine_running, router_running - engine_waiting), tokens_per_s)
    return out
