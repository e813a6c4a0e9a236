"""EngineWatch: the engine's health and restarts, as the agent's heartbeats report them.

Every `interval_s` it asks the engine's health check, then its figures. Healthy means both answered:
an engine that is down makes the agent's engine unhealthy at the control plane (the heartbeat goes out at
once on a change: data_plane.control_client), not stale-and-healthy. The figures carry the engine
process's start time (vLLM: `process_start_time_seconds` in /metrics); when it changes, the engine
restarted and lost every adapter loaded at run time: `on_restart` is called (the agent registers again,
and a registration starts the control plane's reconcile of this engine, which loads its adapters again,
since the listing no longer shows them). The watch has the shape of what a heartbeat reads
(data_plane.control_client.EngineState): `healthy`, `dead_reason`, `stats().lora.slots_used`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from data_plane.agent.adapters import AgentAdapters
from data_plane.agent.kind import EngineCallFailed, EngineKind

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Slots:
    slots_used: int


@dataclass(frozen=True)
class _Figures:
    lora: _Slots


class EngineWatch:
    def __init__(self, engine: EngineKind, adapters: AgentAdapters, interval_s: float,
                 on_restart: Callable[[], None] = lambda: None) -> None:
        self.engine = engine
        self.adapters = adapters
        self.interval_s = interval_s
        self.on_restart = on_restart
        self.healthy = False  # until the first look
        self.dead_reason: str | None = "not checked yet"
        self._started_at: float | None = None

    def stats(self) -> _Figures:
        return _Figures(_Slots(self.adapters.served_count))

    async def run(self) -> None:
        while True:
            await self.look()
            await asyncio.sleep(self.interval_s)

    async def look(self) -> None:
        reason = await self.engine.health()
        if reason is None:
            try:
                figures = await self.engine.stats()
            except EngineCallFailed as exc:
                reason = exc.message
            else:
                self.adapters.observe_figures(figures)
                self._notice(figures.started_at)
        if (reason is None) != self.healthy:
            logger.warning("engine %s is %s", self.engine.url, "healthy again" if reason is None else f"unhealthy: {reason}")
        self.healthy, self.dead_reason = reason is None, reason

    def _notice(self, started_at: float | None) -> None:
        if started_at is None:
            return
        if self._started_at is not None and started_at != self._started_at:
            logger.warning("engine %s restarted (its process start time changed): registering again so that its "
                           "adapters are loaded again", self.engine.url)
            self.adapters.forget()
            self.on_restart()
        self._started_at = started_at
