"""A request's route: the table's holders of its `model`, or a placement the control plane makes on demand.

A model the table lists with holders is routed at once. An adapter nobody holds, or a name the table does
not list, is sent to the control plane (`POST /v1/routes/demand` with `place: [model]`): one call per
model however many requests wait for it (they all await the one task, shielded, so a waiter that goes
away cancels nothing for the others). The answer's routes are merged into the table; a name in its
`unknown` is a 404, in the engines' words, and is remembered as unknown while the table's ETag stays the
same (at most NEGATIVE_TTL_S), so a client repeating a typo costs the control plane nothing. There is
never a fallback to the base model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

import httpx
import msgspec

from data_plane.router.errors import NoEngineError, model_not_found
from data_plane.router.metrics import RouterMetrics
from data_plane.router.table import RoutingTable
from shared.errors import LoraplaneError
from shared.names import name_problem
from shared.routes import DEMAND_PATH, DemandAnswer, DemandReport, ModelRoute

logger = logging.getLogger(__name__)

NEGATIVE_TTL_S = 10.0
NEGATIVE_CACHE_SIZE = 4096
_encoder = msgspec.json.Encoder()
_answer = msgspec.json.Decoder(DemandAnswer)


class Placer:
    def __init__(self, table: RoutingTable, client: httpx.AsyncClient, metrics: RouterMetrics, *,
                 timeout_s: float, negative_ttl_s: float = NEGATIVE_TTL_S) -> None:
        self.table = table
        self.timeout_s = timeout_s
        self.client = client  # the control plane's: base URL and router token
        self.metrics = metrics
        self.negative_ttl_s = negative_ttl_s
        self.waiting: dict[str, int] = {}  # model -> requests waiting for its placement (demand `waiting`)
        self.calls = 0  # placement calls made (one per model and wave of requests)
        self._pending: dict[str, asyncio.Task[ModelRoute | None]] = {}
        self._unknown: OrderedDict[str, tuple[str | None, float]] = OrderedDict()  # name -> (etag, when)

    def held(self, route: ModelRoute) -> bool:
        return any(self.table.engine(h.engine) is not None for h in route.holders)

    async def route_for(self, model: str) -> ModelRoute:
        """The route to send a request for `model` by; NotFoundError (404) or NoEngineError (503)."""
        route = self.table.route(model)
        if route is not None and self.held(route):
            return route
        if route is not None and route.kind == "base":
            raise NoEngineError(f"No engine serving `{model}` is available now; retry later.")
        if name_problem(model) is not None or self._known_unknown(model):
            raise model_not_found(model)
        task = self._pending.get(model)
        if task is None:
            task = asyncio.ensure_future(self._place(model))
            self._pending[model] = task
            task.add_done_callback(lambda _: self._pending.pop(model, None))
        self.waiting[model] = self.waiting.get(model, 0) + 1
        try:
            route = await asyncio.shield(task)
        finally:
            self.waiting[model] -= 1
            if not self.waiting[model]:
                del self.waiting[model]
        if route is None:
            raise model_not_found(model)
        if not self.held(route):
            raise NoEngineError(f"The adapter `{model}` has no engine of its base model `{route.base_model}` "
                                "to run on now; retry later.")
        return route

    async def _place(self, model: str) -> ModelRoute | None:
        self.calls += 1
        try:
            response = await self.client.post(DEMAND_PATH, content=_encoder.encode(DemandReport(place=[model])),
                                              headers={"Content-Type": "application/json"}, timeout=self.timeout_s)
            if response.status_code != 200:
                raise self._failed(model, f"it answered {response.status_code}: {response.text[:200]}")
            answer = _answer.decode(response.content)
        except httpx.HTTPError as exc:
            raise self._failed(model, f"{type(exc).__name__}: {exc}") from None
        except msgspec.DecodeError as exc:
            raise self._failed(model, f"its answer does not decode: {exc}") from None
        self.table.merge(answer.placed)
        route = next((r for r in answer.placed if r.model == model), None)
        if model in answer.unknown or route is None:
            self._remember_unknown(model)
            self.metrics.placements.labels("unknown").inc()
            return None
        self.metrics.placements.labels("placed").inc()
        logger.info("placed %s on demand: %s", model, [(h.engine, h.residency) for h in route.holders])
        return route

    def _known_unknown(self, model: str) -> bool:
        seen = self._unknown.get(model)
        if seen is None:
            return False
        etag, when = seen
        if etag == self.table.etag and time.monotonic() - when < self.negative_ttl_s:
            return True
        del self._unknown[model]
        return False

    def _remember_unknown(self, model: str) -> None:
        self._unknown[model] = (self.table.etag, time.monotonic())
        self._unknown.move_to_end(model)
        if len(self._unknown) > NEGATIVE_CACHE_SIZE:
            self._unknown.popitem(last=False)

    def _failed(self, model: str, why: str) -> LoraplaneError:
        self.metrics.placements.labels("failed").inc()
        logger.warning("cannot ask the control plane to place %s: %s", model, why)
        return NoEngineError(f"Nobody holds `{model}` and the control plane cannot place it now; retry later.")
