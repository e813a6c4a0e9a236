"""The routing table: the control plane's `GET /v1/routes`, revalidated every second, kept when it is down.

`RoutingTable` indexes the last RoutesTable by model and engine name and says how old it is (since the
last answer from the control plane, 200 or 304). `TableRefresher.run()` sends `If-None-Match` with the
ETag it holds: 304 only refreshes the age; 200 replaces the table; an error or any other status keeps the
last table (the router goes on routing by it, and /health says degraded once it is stale).

Placements the router asked for (DemandAnswer.placed) are merged into the table at once (`merge`), so
requests waiting for them are routed before the next revalidation brings the same routes.

`context_length(model)` is the context length a model's requests run in (the routes' `max_model_len`):
what a tenant's request without max_tokens reserves by (usage.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

import httpx
import msgspec

from shared.routes import ROUTES_PATH, ModelRoute, RouteEngine, RoutesTable

logger = logging.getLogger(__name__)

_decoder = msgspec.json.Decoder(RoutesTable)


class RoutingTable:
    def __init__(self) -> None:
        self.etag: str | None = None  # the ETag header as received: sent back verbatim in If-None-Match
        self.engines: dict[str, RouteEngine] = {}
        self.models: dict[str, ModelRoute] = {}
        self.largest_context: int | None = None  # the largest max_model_len of the table's routes
        self.validated_at: float | None = None  # time.monotonic() of the last 200 or 304
        self.changes = 0  # tables received (200)

    @property
    def loaded(self) -> bool:
        return self.validated_at is not None

    def replace(self, table: RoutesTable, etag: str | None) -> None:
        self.engines = {e.name: e for e in table.engines}
        self.models = {m.model: m for m in table.models}
        self.largest_context = max((m.max_model_len for m in table.models if m.max_model_len), default=None)
        self.etag = etag or table.etag
        self.changes += 1
        self.touch()

    def merge(self, routes: Iterable[ModelRoute]) -> None:
        """Routes the control plane answered outside a revalidation (a placement); the next table wins."""
        for route in routes:
            self.models[route.model] = route

    def touch(self) -> None:
        self.validated_at = time.monotonic()

    def age_s(self) -> float | None:
        """Seconds since the control plane last confirmed the table; None before the first."""
        return None if self.validated_at is None else time.monotonic() - self.validated_at

    def route(self, model: str) -> ModelRoute | None:
        return self.models.get(model)

    def context_length(self, model: str) -> int | None:
        """The route's max_model_len, else its base model's; for a model the table does not know (or
        whose engines did not say), the largest the table knows; None when no engine said."""
        route = self.models.get(model)
        if route is not None:
            if route.max_model_len:
                return route.max_model_len
            base = self.models.get(route.base_model)
            if base is not None and base.max_model_len:
                return base.max_model_len
        return self.largest_context

    def engine(self, name: str) -> RouteEngine | None:
        return self.engines.get(name)


class TableRefresher:
    """Keeps a RoutingTable current from the control plane (`client` has its base URL and router token)."""

    def __init__(self, table: RoutingTable, client: httpx.AsyncClient, interval_s: float,
                 on_result: Callable[[str], None] | None = None) -> None:
        self.table = table
        self.client = client
        self.interval_s = interval_s
        self.on_result = on_result  # e.g. a metric: called with each revalidation's result
        self.results: dict[str, int] = {"changed": 0, "not_modified": 0, "failed": 0}  # for /metrics and tests
        self._failing = False  # an outage is logged when it starts and when it ends, not every second

    async def refresh(self) -> str:
        """One revalidation: "changed" (200), "not_modified" (304) or "failed" (table kept)."""
        headers = {"If-None-Match": self.table.etag} if self.table.etag else {}
        try:
            response = await self.client.get(ROUTES_PATH, headers=headers)
            if response.status_code == 304:
                self.table.touch()
                return self._count("not_modified")
            if response.status_code != 200:
                return self._fail(f"the control plane answered {response.status_code}: {response.text[:200]}")
            table = _decoder.decode(response.content)
        except httpx.HTTPError as exc:
            return self._fail(f"{type(exc).__name__}: {exc}")
        except msgspec.DecodeError as exc:
            return self._fail(f"the routing table does not decode: {exc}")
        self.table.replace(table, response.headers.get("etag"))
        logger.debug("routing table %s: %d engines, %d models", self.table.etag, len(table.engines), len(table.models))
        return self._count("changed")

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval_s)

    def _count(self, result: str) -> str:
        if self._failing:
            self._failing = False
            logger.info("the control plane answers again: routing table %s", self.table.etag)
        return self._record(result)

    def _fail(self, why: str) -> str:
        if not self._failing:
            self._failing = True
            kept = "keeping the last table" if self.table.loaded else "no table yet"
            logger.warning("cannot revalidate the routing table (%s); %s", why, kept)
        return self._record("failed")

    def _record(self, result: str) -> str:
        self.results[result] += 1
        if self.on_result is not None:
            self.on_result(result)
        return result
