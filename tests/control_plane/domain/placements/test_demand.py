"""current_demand on real rows in SQLite and PostgreSQL: a request a router sent to an engine is in both
reports and counts once; what routers hold waiting for a placement adds; stale rows count for nothing."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from control_plane.db import migrate
from control_plane.db.models import Adapter, DemandReport
from control_plane.domain.placements.demand import (
    AdapterDemand,
    current_demand,
    record_demand,
    replace_demand,
)


@pytest.fixture
async def session(db_url: str) -> AsyncIterator[AsyncSession]:
    engine = create_async_engine(db_url)
    await migrate.upgrade(engine)
    async with async_sessionmaker(engine, expire_on_commit=False)() as s:
        s.add_all(Adapter(name=f"a{k}", base_model="demo", description="", labels={}) for k in range(4))
        await s.commit()
        yield s
    await engine.dispose()


async def ids(session: AsyncSession) -> list[int]:
    rows = await session.execute(Adapter.__table__.select().order_by(Adapter.name))
    return [row.id for row in rows]


async def test_a_routed_request_counts_once(session: AsyncSession) -> None:
    a0, a1, a2, a3 = await ids(session)
    # a0: 10 requests through one router; the two engines holding it have 3 waiting and 7 running of them
    await replace_demand(session, "engine:ea", [AdapterDemand(a0, 2, 4, 40.0), AdapterDemand(a1, 0, 5, 9.0)])
    await replace_demand(session, "engine:eb", [AdapterDemand(a0, 1, 3, 30.0)])
    await record_demand(session, "router:1:r1", [AdapterDemand(a0, 0, 10)])
    # a1: 5 running at an engine, 2 of them sent by a router, which holds 4 more waiting for a placement
    await record_demand(session, "router:1:r2", [AdapterDemand(a1, 4, 2)])
    # a2: a router's figures ahead of the engines' report (sent since), two routers
    await record_demand(session, "router:1:r1", [AdapterDemand(a2, 0, 6)])
    await record_demand(session, "router:2", [AdapterDemand(a2, 1, 3)])
    # a3: direct clients only
    await replace_demand(session, "engine:ec", [AdapterDemand(a3, 2, 1, 5.0)])
    await session.commit()

    demand = await current_demand(session, max_age_s=60)
    total = {a: d.waiting + d.running for a, d in demand.items()}
    assert total == {a0: 10, a1: 9, a2: 10, a3: 3}
    assert demand[a0] == AdapterDemand(a0, waiting=3, running=7, tokens_per_s=70.0)
    assert demand[a1] == AdapterDemand(a1, waiting=4, running=5, tokens_per_s=9.0)
    assert demand[a2] == AdapterDemand(a2, waiting=1, running=9, tokens_per_s=0.0)
    assert demand[a3] == AdapterDemand(a3, waiting=2, running=1, tokens_per_s=5.0)


async def test_stale_reports_count_for_nothing(session: AsyncSession) -> None:
    a0, a1, *_ = await ids(session)
    await replace_demand(session, "engine:ea", [AdapterDemand(a0, 0, 4, 1.0)])
    await record_demand(session, "router:1", [AdapterDemand(a0, 0, 4), AdapterDemand(a1, 5, 0)])
    await session.execute(update(DemandReport).where(DemandReport.source == "router:1")
                          .values(reported_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=120)))
    await session.commit()
    assert await current_demand(session, max_age_s=60) == {a0: AdapterDemand(a0, 0, 4, 1.0)}
