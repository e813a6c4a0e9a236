"""StatsService: fetch every healthy engine's figures concurrently and combine them per adapter.

Each engine is asked for /v1/lora_stats (counters, loads, evictions), /v1/lora_adapters (residency) and
/metrics (the latency histograms). The last figures each engine gave are kept in memory, so an engine
that stops answering still contributes them, with their age and the error of the failed fetch.

Engines are fetched independently: each call is bounded by the client's deadline and body cap, and
replies are typed (shared.engine_admin), so a slow, broken or hostile engine is one row with an
`error`, never a slow or failed answer for the fleet. Unparseable /metrics text costs that engine its
latency figures only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.db.models import Engine
from control_plane.domain.engines.health import healthy_clause
from control_plane.domain.stats import histogram, schemas
from control_plane.engine_client import EngineAt, EngineCallError, EngineClient
from control_plane.settings import ControlPlaneSettings
from shared import engine_admin

logger = logging.getLogger(__name__)


@dataclass
class EngineSnapshot:
    fetched_at: float  # time.monotonic()
    stats: engine_admin.LoraStats
    residency: dict[str, str | None]  # an adapter ready on the engine -> its residency (None: not said)
    buckets: histogram.Buckets


@dataclass
class StatsCache:
    """Per engine name: the last figures it gave and the error of its last failed fetch (if any)."""

    snapshots: dict[str, EngineSnapshot] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


class StatsService:
    def __init__(self, session: AsyncSession, settings: ControlPlaneSettings, client: EngineClient,
                 cache: StatsCache) -> None:
        self.session = session
        self.settings = settings
        self.client = client
        self.cache = cache

    async def lora_stats(self) -> schemas.LoraStats:
        engines = list((await self.session.execute(
            select(Engine.name, Engine.url).where(healthy_clause(self.settings.engine_stale_after_s))
            .order_by(Engine.name))).all())
        outcomes = await asyncio.gather(*(self._fetch(name, url) for name, url in engines), return_exceptions=True)
        for (name, _), outcome in zip(engines, outcomes, strict=True):
            if isinstance(outcome, Exception):  # a bug here must cost this engine's row, not the answer
                logger.error("fetching the figures of engine %s failed", name, exc_info=outcome)
                self.cache.errors[name] = "internal error while fetching this engine's figures"
        now = time.monotonic()
        names = [name for name, _ in engines]
        snapshots = {n: self.cache.snapshots[n] for n in names if n in self.cache.snapshots}
        figures = [schemas.EngineFigures(engine=n, error=self.cache.errors.get(n),
                                         age_s=round(now - snapshots[n].fetched_at, 3) if n in snapshots else None)
                   for n in names]
        return schemas.LoraStats(adapters=_combine(snapshots, now), engines=figures)

    async def _fetch(self, name: str, url: str) -> None:
        try:
            at = EngineAt(name, url)
            stats, listing, metrics = await asyncio.gather(
                self.client.stats(at), self.client.list_adapters(at), self.client.metrics(at))
        except EngineCallError as exc:
            self.cache.errors[name] = exc.message
            return
        residency = {a.name: a.residency for a in listing.adapters if a.state == "ready"}
        try:
            buckets = histogram.parse_buckets(metrics)
            error = None
        except Exception as exc:  # a third-party parser on an engine's text: anything may come out of it
            logger.info("engine %s: unparseable /metrics (%s)", name, type(exc).__name__)
            buckets, error = histogram.empty(), "/metrics: not valid Prometheus text; latency figures left out"
        self.cache.snapshots[name] = EngineSnapshot(time.monotonic(), stats, residency, buckets)
        if error is None:
            self.cache.errors.pop(name, None)
        else:
            self.cache.errors[name] = error


def _latency(buckets: dict[float, float]) -> schemas.Latency:
    count = max(buckets.values(), default=0.0)
    return schemas.Latency(p50=histogram.quantile(0.5, buckets), p99=histogram.quantile(0.99, buckets),
                           samples=int(count))


def _combine(snapshots: dict[str, EngineSnapshot], now: float) -> list[schemas.AdapterStats]:
    per_adapter: dict[str, list[tuple[str, EngineSnapshot, engine_admin.AdapterFigures]]] = {}
    for engine, snap in snapshots.items():
        for row in snap.stats.adapters:
            per_adapter.setdefault(row.name, []).append((engine, snap, row))
    out = []
    for name in sorted(per_adapter):
        requests: Counter[str] = Counter()
        ttft: dict[float, float] = {}
        e2e: dict[float, float] = {}
        rows = []
        for engine, snap, row in per_adapter[name]:
            requests.update(row.requests)
            mine_ttft = snap.buckets[histogram.TTFT].get(name, {})
            mine_e2e = snap.buckets[histogram.E2E].get(name, {})
            histogram.add(ttft, mine_ttft)
            histogram.add(e2e, mine_e2e)
            rows.append(schemas.EngineAdapterStats(
                engine=engine, residency=snap.residency.get(name), requests=dict(row.requests),
                generated_tokens=row.generated_tokens, ttft_seconds=_latency(mine_ttft),
                e2e_seconds=_latency(mine_e2e), age_s=round(now - snap.fetched_at, 3)))
        entries = [row for _, _, row in per_adapter[name]]
        out.append(schemas.AdapterStats(
            name=name, requests=dict(requests),
            prompt_tokens=sum(r.prompt_tokens for r in entries),
            generated_tokens=sum(r.generated_tokens for r in entries),
            generated_tokens_per_second_1m=round(sum(r.generated_tokens_per_second_1m for r in entries), 3),
            loads=sum(r.loads for r in entries), evictions=sum(r.evictions for r in entries),
            ttft_seconds=_latency(ttft), e2e_seconds=_latency(e2e), engines=rows))
    return out
