"""GET /v1/lora_stats: one thin handler over StatsService."""

from __future__ import annotations

from litestar import Controller, get
from litestar.datastructures import State
from litestar.di import Provide
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.auth import read_guard
from control_plane.domain.stats import schemas
from control_plane.domain.stats.service import StatsService
from shared.openapi import route_doc


async def provide_stats_service(db_session: AsyncSession, state: State) -> StatsService:
    return StatsService(db_session, state.settings, state.engine_client, state.stats_cache)


class StatsController(Controller):
    path = "/v1"
    tags = ["stats"]
    guards = [read_guard]
    dependencies = {"service": Provide(provide_stats_service)}

    @get("/lora_stats", operation_id="loraStats", opt=route_doc(response=schemas.LoraStats))
    async def lora_stats(self, service: StatsService) -> schemas.LoraStats:
        """Per adapter across the healthy engines: requests by outcome, tokens, loads and evictions summed;
        TTFT and end-to-end p50/p99 from the engines' summed histograms; a row per engine with its
        residency and the age of its figures (an engine that stops answering keeps its last ones)."""
        return await service.lora_stats()
