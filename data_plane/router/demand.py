"""The router's demand report: every interval, `POST /v1/routes/demand` with each adapter's queue here.

`waiting` counts requests waiting for a placement (placement.Placer), `running` those sent to an engine and
not finished (balancer.Balancer). Only adapters the table lists are reported (the control plane scales
adapters, not base models); a model whose figures fell to zero is reported once more as zero, then not
again. Every report carries the router's presence (its name, URL and totals: the console's Fleet page
lists routers by it), and an idle router reports just that every `presence_interval_s`. A failed report
is logged once per outage and not retried: the next interval brings fresher figures.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx
import msgspec

from data_plane.router.balancer import Balancer
from data_plane.router.metrics import RouterMetrics
from data_plane.router.placement import Placer
from data_plane.router.table import RoutingTable
from shared.routes import DEMAND_PATH, MAX_DEMAND_MODELS, DemandReport, ModelDemand, RouterPresence

logger = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()


@dataclass(frozen=True)
class Presence:
    name: str  # empty: the router does not report itself (an embedded router without a name)
    url: str | None
    interval_s: float  # the longest an idle router stays silent
    require_api_key: bool = False  # reported: the control plane says whether any router enforces tenancy


class DemandReporter:
    def __init__(self, table: RoutingTable, balancer: Balancer, placer: Placer, client: httpx.AsyncClient,
                 interval_s: float, metrics: RouterMetrics, presence: Presence | None = None) -> None:
        self.metrics = metrics
        self.presence = presence if presence is not None and presence.name else None
        self._presence_sent = float("-inf")  # time.monotonic() of the last report the control plane took
        self.table = table
        self.balancer = balancer
        self.placer = placer
        self.client = client
        self.interval_s = interval_s
        self.reports = 0  # reports the control plane accepted
        self._last: set[str] = set()  # models reported non-zero last time
        self._failing = False

    def figures(self) -> list[ModelDemand]:
        running, waiting = self.balancer.running, self.placer.waiting
        names = set(running) | set(waiting) | self._last
        out = []
        for name in sorted(names):
            route = self.table.route(name)
            if route is not None and route.kind == "adapter":
                out.append(ModelDemand(model=name, waiting=waiting.get(name, 0), running=running.get(name, 0)))
        if len(out) > MAX_DEMAND_MODELS:  # the busiest first, as many as one report may carry
            out = sorted(out, key=lambda d: d.waiting + d.running, reverse=True)[:MAX_DEMAND_MODELS]
        return out

    def me(self) -> RouterPresence | None:
        if self.presence is None:
            return None
        age = self.table.age_s()
        return RouterPresence(name=self.presence.name, url=self.presence.url,
                              running=sum(self.balancer.running.values()), waiting=sum(self.placer.waiting.values()),
                              table_age_s=None if age is None else round(age, 3),
                              require_api_key=self.presence.require_api_key)

    async def report(self) -> bool:
        """One report (none when there is nothing to say); whether the control plane took it."""
        figures = self.figures()
        due = self.presence is not None and time.monotonic() - self._presence_sent >= self.presence.interval_s
        if not figures and not due:
            return False
        body = DemandReport(router=self.me(), demand=figures)
        try:
            response = await self.client.post(DEMAND_PATH, content=_encoder.encode(body),
                                              headers={"Content-Type": "application/json"})
            if response.status_code != 200:
                return self._fail(f"it answered {response.status_code}: {response.text[:200]}")
        except httpx.HTTPError as exc:
            return self._fail(f"{type(exc).__name__}: {exc}")
        self._last = {f.model for f in figures if f.waiting or f.running}
        self._presence_sent = time.monotonic()
        self.reports += 1
        self.metrics.demand_reports.labels("ok").inc()
        self._failing = False
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.report()

    def _fail(self, why: str) -> bool:
        self.metrics.demand_reports.labels("failed").inc()
        if not self._failing:
            self._failing = True
            logger.warning("cannot report demand to the control plane: %s", why)
        return False
