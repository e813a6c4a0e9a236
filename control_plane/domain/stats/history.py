"""The fleet's figures over time, kept by the control plane itself: every reconcile interval the sampler
asks the engines for their stats (StatsService, as GET /v1/lora_stats does) and writes one stats_samples
row per adapter; rows older than HISTORY_S go in the same transaction, so the table stays bounded.

Counters are stored as the engines' running totals and turned into rates when read (`series`): a drop
(an engine restarted) is a gap, not a negative rate. TTFT percentiles are those of the requests finished
since this process's previous sample (the difference of the summed histograms). With two replicas both
sample; `series` keeps one row per half interval, so their rows do not make a jagged line.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.db.models import StatsSample
from control_plane.db.session import WriteGate
from control_plane.db.transaction import transact
from control_plane.domain.engines.health import now
from control_plane.domain.stats import histogram
from control_plane.domain.stats.service import StatsCache, StatsService
from control_plane.engine_client import EngineClient
from control_plane.periodic import Periodic
from control_plane.settings import ControlPlaneSettings

logger = logging.getLogger(__name__)

HISTORY_S = 3600.0  # what the charts show, and all the table keeps


@dataclass(frozen=True)
class Series:
    """One adapter's chart data, oldest first; None where there is no figure (a gap in the line)."""

    at: list[str] = field(default_factory=list)  # HH:MM:SS UTC
    tokens_per_s: list[float | None] = field(default_factory=list)
    requests_per_s: list[float | None] = field(default_factory=list)
    error_rate: list[float | None] = field(default_factory=list)  # errors / requests in the step
    ttft_p50_s: list[float | None] = field(default_factory=list)
    ttft_p99_s: list[float | None] = field(default_factory=list)


def rates(samples: list[StatsSample], min_step_s: float) -> Series:
    """Chart data from one adapter's samples (oldest first): each kept sample after the first gives the
    rates over the step from the one before. Samples closer than `min_step_s` to the last kept are
    skipped (another replica's)."""
    out = Series()
    kept: StatsSample | None = None
    for sample in samples:
        if kept is not None and (sample.at - kept.at).total_seconds() < min_step_s:
            continue
        if kept is not None:
            step = (sample.at - kept.at).total_seconds()
            requests, errors = sample.requests - kept.requests, sample.errors - kept.errors
            tokens = sample.generated_tokens - kept.generated_tokens
            reset = min(requests, errors, tokens) < 0  # an engine restarted: its totals began again
            out.at.append(sample.at.strftime("%H:%M:%S"))
            out.tokens_per_s.append(None if reset else round(tokens / step, 3))
            out.requests_per_s.append(None if reset else round(requests / step, 3))
            out.error_rate.append(None if reset else round(errors / requests, 4) if requests else 0.0)
            out.ttft_p50_s.append(sample.ttft_p50)
            out.ttft_p99_s.append(sample.ttft_p99)
        kept = sample
    return out


async def series(session: AsyncSession, adapter: str, interval_s: float) -> Series:
    """The last HISTORY_S of one adapter's samples as chart data."""
    since = now() - dt.timedelta(seconds=HISTORY_S)
    rows = (await session.scalars(select(StatsSample).where(StatsSample.adapter == adapter, StatsSample.at >= since)
                                  .order_by(StatsSample.at))).all()
    return rates(list(rows), interval_s / 2)


class HistorySampler:
    """Samples every `reconcile_interval_s` until stopped; a failed sample is logged and skipped."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession], gate: WriteGate, settings: ControlPlaneSettings,
                 client: EngineClient, cache: StatsCache) -> None:
        self.sessions, self.gate, self.settings, self.client, self.cache = sessions, gate, settings, client, cache
        self._previous_ttft: dict[str, dict[float, float]] = {}  # adapter -> summed TTFT buckets last time
        self._rounds = Periodic("stats-history", settings.reconcile_interval_s, self.sample,
                                what="sampling the fleet's stats for the console's history")

    async def start(self) -> None:
        await self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()

    async def sample(self) -> int:
        """One sample of every adapter the healthy engines report; the rows written."""
        async with self.sessions() as session:
            stats = await StatsService(session, self.settings, self.client, self.cache).lora_stats()
            at = now()
            rows = []
            for adapter in stats.adapters:
                p50, p99 = self._ttft_since_last(adapter.name)
                rows.append(StatsSample(adapter=adapter.name, at=at, requests=sum(adapter.requests.values()),
                                        errors=adapter.requests.get("error", 0),
                                        generated_tokens=adapter.generated_tokens, ttft_p50=p50, ttft_p99=p99))

            async def write(session: AsyncSession) -> None:
                await session.execute(delete(StatsSample).where(StatsSample.at < at - dt.timedelta(seconds=HISTORY_S)))
                session.add_all(rows)

            await transact(session, self.gate, write, what="recording the stats history", idempotent=False)
            return len(rows)

    def _ttft_since_last(self, adapter: str) -> tuple[float | None, float | None]:
        """TTFT p50/p99 of the requests finished since the previous sample, from the engines' histograms."""
        summed: dict[float, float] = {}
        for snapshot in self.cache.snapshots.values():
            histogram.add(summed, snapshot.buckets[histogram.TTFT].get(adapter, {}))
        previous = self._previous_ttft.get(adapter)
        self._previous_ttft[adapter] = summed
        if previous is None:
            return None, None
        step = {bound: count - previous.get(bound, 0.0) for bound, count in summed.items()}
        if any(count < 0 for count in step.values()):  # an engine restarted or left: no step to speak of
            return None, None
        return histogram.quantile(0.5, step), histogram.quantile(0.99, step)
