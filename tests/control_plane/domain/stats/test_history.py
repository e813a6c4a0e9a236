"""The console's history: rates from the stored running totals (a restart is a gap, another replica's
near-simultaneous sample is skipped), and a sample round on SQLite and PostgreSQL that keeps the table bounded."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import async_sessionmaker

from control_plane.db import migrate
from control_plane.db.models import StatsSample
from control_plane.db.session import WriteGate, create_engine
from control_plane.domain.engines.health import now
from control_plane.domain.stats.history import HISTORY_S, HistorySampler, rates, series
from control_plane.domain.stats.service import StatsCache
from control_plane.engine_client import EngineClient
from control_plane.settings import ControlPlaneSettings

T0 = dt.datetime(2026, 12, 3, 7, 0, tzinfo=dt.UTC)


def sample(at_s: float, requests: int, errors: int, tokens: int, p50: float | None = None) -> StatsSample:
    return StatsSample(adapter="a", at=T0 + dt.timedelta(seconds=at_s), requests=requests, errors=errors,
                       generated_tokens=tokens, ttft_p50=p50, ttft_p99=p50)


def test_rates_over_each_step_gaps_after_a_restart_and_one_row_per_half_interval() -> None:
    out = rates([sample(0, 10, 0, 100), sample(10, 30, 5, 300, 0.2), sample(12, 31, 5, 310),  # another replica's
                 sample(20, 40, 5, 500, 0.3), sample(30, 2, 0, 20), sample(40, 2, 0, 20)], min_step_s=5)
    assert out.at == ["07:00:10", "07:00:20", "07:00:30", "07:00:40"]
    assert out.requests_per_s == [2.0, 1.0, None, 0.0]
    assert out.tokens_per_s == [20.0, 20.0, None, 0.0]
    assert out.error_rate == [0.25, 0.0, None, 0.0]
    assert out.ttft_p50_s == [0.2, 0.3, None, None]


async def test_a_sample_round_drops_rows_older_than_the_window(db_url: str) -> None:
    settings = ControlPlaneSettings(database_url=db_url)
    engine = create_engine(settings)
    await migrate.upgrade(engine)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    old = now() - dt.timedelta(seconds=HISTORY_S + 60)
    async with sessions() as session:
        session.add_all([StatsSample(adapter="a", at=old, requests=1, errors=0, generated_tokens=1),
                         StatsSample(adapter="a", at=now() - dt.timedelta(seconds=30), requests=1, errors=0,
                                     generated_tokens=1)])
        await session.commit()
    client = EngineClient(None, 1.0)
    sampler = HistorySampler(sessions, WriteGate(serialize=settings.is_sqlite), settings, client, StatsCache())
    assert await sampler.sample() == 0  # no engine: nothing to add, the old row goes
    async with sessions() as session:
        assert await session.scalar(select(func.count()).select_from(StatsSample)) == 1
        assert (await series(session, "a", 30)).at == []  # one row: no step yet
    await client.aclose()
    await engine.dispose()
