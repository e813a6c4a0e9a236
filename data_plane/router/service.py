"""RouterService: one request's way through the router, and the parts it is made of.

    client key → body (at most max_request_body_bytes) → parse_head (model, stream, prompt prefix)
         → [--max-request-tokens: the request's token reservation within it? (usage.py)]
         → [a tenant key: Tenancy.admit (may it use the model? within its quotas?)]
         → Placer.route_for (table, or a placement) → Balancer.order (residency, outstanding, the
         affinity) → Proxy.forward (retries, then the engine's answer relayed to the client)

A tenant's request that no engine accepted (every engine tried refused the router's credentials or
answered 503, none could be reached, or none holds the model) is settled as UNSERVED: its quotas are
given back (tenancy.py).

`complete` is called with the raw ASGI triple (app.py's fast path: Litestar's request and response
machinery cost more than the whole proxying did). Errors before the answer starts are raised as
LoraplaneError (or Litestar's 413) for the app's exception handlers to answer in OpenAI's shape. After
the body is read the rest runs under `until_disconnect`: a client that goes away while its request waits
for a placement or for an engine's answer, streamed or not, cancels it, and the engine's request is
aborted by the closing of its connection.

`start()` opens the engines' connection pool and launches the routing-table revalidation and the demand
reports; `stop()` ends them and closes the connection pools.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import msgspec
from litestar.exceptions import HTTPException
from litestar.status_codes import HTTP_413_REQUEST_ENTITY_TOO_LARGE

from data_plane.router.balancer import Balancer
from data_plane.router.config import RouterConfig
from data_plane.router.demand import DemandReporter, Presence
from data_plane.router.errors import UNSERVED as UNSERVED_ERRORS
from data_plane.router.errors import NoEngineError
from data_plane.router.keys import OPERATOR, Caller
from data_plane.router.metrics import RouterMetrics
from data_plane.router.placement import Placer
from data_plane.router.proxy import DONE, Proxy, Send, engine_session
from data_plane.router.quotas import RateLimited
from data_plane.router.request import adapter_key, check_required, parse_head, prefix_key
from data_plane.router.table import RoutingTable, TableRefresher
from data_plane.router.tenancy import UNSERVED, Tenancy, Ticket
from data_plane.router.tenant_metrics import TenantMetrics
from data_plane.router.usage import UsageTap, check_ceiling, reservation
from shared.disconnect import ClientDisconnected, client_gone, until_disconnect
from shared.errors import LoraplaneError

logger = logging.getLogger(__name__)
Receive = Callable[[], Awaitable[dict[str, Any]]]


class RouterService:
    def __init__(self, config: RouterConfig, *, rng: random.Random | None = None) -> None:
        self.config = config
        headers = {"Authorization": f"Bearer {config.router_token}"} if config.router_token else {}
        self.control_plane = httpx.AsyncClient(base_url=config.control_plane_url, headers=headers,
                                               timeout=config.control_plane_timeout_s)
        self.table = RoutingTable()
        self.balancer = Balancer(prefix_cache_size=config.prefix_cache_size, affinity_slack=config.affinity_slack,
                                 engine_down_s=config.engine_down_s, rng=rng)
        self.metrics = RouterMetrics(config.max_model_labels, self.table.age_s, lambda: self.balancer.outstanding)
        self.refresher = TableRefresher(self.table, self.control_plane, config.refresh_interval_s,
                                        lambda result: self.metrics.revalidations.labels(result).inc())
        self.placer = Placer(self.table, self.control_plane, self.metrics, timeout_s=config.placement_timeout_s)
        self.reporter = DemandReporter(self.table, self.balancer, self.placer, self.control_plane,
                                       config.demand_interval_s, self.metrics,
                                       Presence(config.name, config.advertise_url, config.presence_interval_s,
                                                config.require_api_key))
        self.proxy = Proxy(self.balancer, self.metrics, engine_api_key=config.engine_api_key,
                           max_attempts=config.max_attempts)
        self.tenancy = Tenancy(config, self.control_plane, TenantMetrics(self.metrics.registry, config.max_model_labels))
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        config = self.config
        self.proxy.session = engine_session(connect_timeout_s=config.connect_timeout_s,
                                            read_timeout_s=config.read_timeout_s,
                                            max_connections=config.max_connections)
        await self.refresher.refresh()  # a table before the first request, if the control plane answers
        self._tasks = [asyncio.create_task(self.refresher.run(), name="router:routes"),
                       asyncio.create_task(self.reporter.run(), name="router:demand"), *await self.tenancy.start()]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.tenancy.stop()
        if self.proxy.session is not None:
            await self.proxy.session.close()
        await self.control_plane.aclose()

    async def complete(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        """POST scope["path"] (/v1/chat/completions or /v1/completions) through an engine, answering on `send`."""
        model = ""
        try:
            authorization, length = _headers(scope)
            caller = await self.tenancy.caller(authorization, (scope.get("client") or ("",))[0])
            body = await _body(receive, length, self.config.max_request_body_bytes)
            head = parse_head(body)
            check_required(head, scope["path"])
            model = head.model
            prefix = prefix_key(head, self.config.prefix_chars)
            if caller.tenant is None:  # an operator's static key, or an open router
                if self.config.max_request_tokens is not None:
                    check_ceiling(reservation(body, self.table.context_length(model)), self.config.max_request_tokens)
                await until_disconnect(receive, self._route(scope["path"], body, head.model, prefix, send))
            else:
                route = self.table.route(head.model)
                ticket = await self.tenancy.admit(caller, head.model, route is not None and route.kind == "base",
                                                  body, head.stream, self.table.context_length(model))
                await self._route_ticket(ticket, scope["path"], head.model, prefix, receive, send)
        except ClientDisconnected:
            return  # nobody reads an answer now; the engine's request (if any) was aborted and counted
        except RateLimited as exc:
            self.metrics.request(model, "", "rejected")
            await _send_rate_limited(exc, send)
        except (LoraplaneError, HTTPException) as exc:
            status = exc.status_code
            if not isinstance(exc, NoEngineError):  # counted where it happens
                self.metrics.request(model if status != 404 else "", "", "not_found" if status == 404 else "rejected")
            raise

    async def _route_ticket(self, ticket: Ticket, path: str, model: str, prefix: int | None, receive: Receive,
                            send: Send) -> None:
        """_route for an admitted tenant request, settled here whatever ends it: settling inside the routed
        work alone would miss a client that left before that work ever ran (its lease held to expiry)."""
        outcome = "error"
        answered = [0]  # the status the engine answered with

        async def settling_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                answered[0] = message["status"]
            # the answer's end as the client sees it: its last bytes, or a stream's [DONE] (a client may
            # stop reading there); an engine's 503 (the last one tried was draining or full) served nothing
            if message["type"] == "http.response.body" and (
                    not message.get("more_body", False) or message.get("body", b"").endswith(DONE)):
                await self.tenancy.settle_before_end(ticket, UNSERVED if answered[0] == 503 else "ok")
            await send(message)

        try:
            work = self._route(path, ticket.body, model, prefix, settling_send, headers=ticket.headers,
                               tap=ticket.tap)
            await until_disconnect(receive, work)
            outcome = "ok"
        except ClientDisconnected:
            outcome = "abort"
            raise
        except UNSERVED_ERRORS:
            outcome = UNSERVED  # no engine accepted it: it costs its tenant nothing
            raise
        finally:
            self.tenancy.settle(ticket, outcome)

    async def _route(self, path: str, body: bytes, model: str, prefix: int | None, send: Send, *,
                     headers: list[tuple[bytes, bytes]] | None = None, tap: UsageTap | None = None) -> None:
        route = await self.placer.route_for(model)
        # an adapter's requests go where it was last served (it is likely still in a device slot there),
        # whatever their prompts; base-model ones where their prompt prefix was
        affinity = prefix if route.kind == "base" else adapter_key(model)
        candidates = self.balancer.order(route, self.table, affinity)
        if not candidates:
            self.metrics.request(model, "", "unavailable")
            raise NoEngineError(f"No engine holding `{model}` is available now; retry later.")
        await self.proxy.forward(candidates, path, body, model, send, kind=route.kind, affinity=affinity,
                                 headers=headers or (), tap=tap)

    def cards(self, caller: Caller = OPERATOR) -> list[dict[str, Any]]:
        """GET /v1/models: the fleet's base models and active adapters, as the table lists them; for a
        tenant key, those it may use."""
        return [{"id": m.model, "object": "model", "created": 0, "owned_by": "loraplane", "root": m.model,
                 "parent": None if m.kind == "base" else m.base_model}
                for m in sorted(self.table.models.values(), key=lambda m: (m.kind != "base", m.model))
                if self.tenancy.may_use(caller, m.model, m.kind == "base")]

    def health(self) -> tuple[int, dict[str, Any]]:
        """200 ok; 200 degraded once the table is stale (routing goes on by it); 503 before any table."""
        age = self.table.age_s()
        if age is None:
            return 503, NoEngineError("No routing table yet: the control plane has not answered.").to_body()
        status = "ok" if age <= self.config.stale_after_s else "degraded"
        body: dict[str, Any] = {"status": status, "routing_table": {
            "etag": self.table.etag, "age_s": round(age, 3), "engines": len(self.table.engines),
            "models": len(self.table.models)}}
        if status == "degraded":
            body["reason"] = (f"the control plane has not confirmed the routing table for {age:.0f}s; "
                              "routing by the last one")
        tenancy, why = self.tenancy.health(), self.tenancy.degraded()
        if tenancy is not None:
            body["tenancy"] = tenancy
        if why is not None:
            body["status"] = "degraded"
            body["reason"] = "; ".join(filter(None, [body.get("reason"), why]))
        return 200, body


async def _send_rate_limited(exc: RateLimited, send: Send) -> None:
    """429 in OpenAI's shape with Retry-After (unless no retry can help) and the x-ratelimit headers
    (answered here: the app's error handlers know no headers)."""
    body = msgspec.json.encode(exc.to_body())
    retry = [] if exc.retry_after_s is None else [(b"retry-after", str(max(1, round(exc.retry_after_s))).encode())]
    await send({"type": "http.response.start", "status": 429, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *retry,
        *exc.headers]})
    await send({"type": "http.response.body", "body": body})


def _headers(scope: dict[str, Any]) -> tuple[str | None, int | None]:
    """The request's Authorization and Content-Length, from the ASGI scope's raw header list."""
    authorization = length = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            authorization = value.decode("latin-1")
        elif name == b"content-length" and value.isdigit():
            length = int(value)
    return authorization, length


async def _body(receive: Receive, length: int | None, limit: int) -> bytes:
    """The whole request body; Litestar's own 413 (answered by the app's handlers) past `limit` bytes."""
    if length is not None and length > limit:
        raise HTTPException(status_code=HTTP_413_REQUEST_ENTITY_TOO_LARGE)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise client_gone()
        part = message.get("body", b"")
        size += len(part)
        if size > limit:
            raise HTTPException(status_code=HTTP_413_REQUEST_ENTITY_TOO_LARGE)
        parts.append(part)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)
