"""Demand figures per adapter, as engines and routers report them (demand_reports rows).

Each source keeps one row per adapter, replaced by its next report; demand scaling reads the sum of the
rows fresher than its window (`current_demand`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import delete, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.db.models import DemandReport
from control_plane.domain.engines.health import now


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
    """The sum over sources of each adapter's figures reported within the last `max_age_s`."""
    since = now() - dt.timedelta(seconds=max_age_s)
    rows = (await session.execute(
        select(DemandReport.adapter_id, func.sum(DemandReport.waiting), func.sum(DemandReport.running),
               func.sum(DemandReport.tokens_per_s))
        .where(DemandReport.reported_at >= since).group_by(DemandReport.adapter_id)
    )).all()
    return {a: AdapterDemand(a, int(w or 0), int(r or 0), float(t or 0.0)) for a, w, r, t in rows}
