"""The agent's HTTP API: the engine admin routes the control plane calls (shared.engine_admin's shapes),
its health and its metrics.

The four admin routes need the agent's admin token when one is set (shared.admin_auth: the control plane
sends this engine's own token, control_plane/engine_tokens.py), listings included, since they name where
files lie. /health answers 200 while the engine answers its health check, 503 with the reason otherwise;
/metrics is the agent's own exposition. Errors are in the OpenAI shape (shared.http_errors).
"""

from __future__ import annotations

from typing import Any

from litestar import Litestar, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.handlers.base import BaseRouteHandler
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from data_plane.agent.runtime import AgentRuntime
from shared import engine_admin
from shared.admin_auth import check_admin
from shared.http_errors import exception_handlers
from shared.openapi import decode_body, document_app, route_doc

_ADMIN_ERRORS = (400, 401, 403, 413)
MAX_BODY_BYTES = 1 << 20


async def admin_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    check_admin(connection.headers.get("authorization"), connection.app.state.agent.config.admin_token)


@post("/v1/load_lora_adapter", status_code=200, guards=[admin_guard], operation_id="loadLoraAdapter",
      # 409: other files under the name without load_inplace; 502: the artifact or the engine failed
      opt=route_doc(request=engine_admin.LoadLoRAAdapterRequest, response=engine_admin.LoadedAdapter,
                    errors=(*_ADMIN_ERRORS, 409, 502, 503)))
async def load_lora_adapter(request: Request[Any, Any, Any], state: State) -> engine_admin.LoadedAdapter:
    """Fetch the version by digest into --adapter-dir, check every file's sha256, then have the engine load
    that folder (in place when it serves the name with other files)."""
    agent: AgentRuntime = state.agent
    return await agent.adapters.load(decode_body(await request.body(), engine_admin.LoadLoRAAdapterRequest))


@post("/v1/unload_lora_adapter", status_code=200, guards=[admin_guard], operation_id="unloadLoraAdapter",
      opt=route_doc(request=engine_admin.UnloadLoRAAdapterRequest, response=engine_admin.UnloadedAdapter,
                    errors=(*_ADMIN_ERRORS, 404, 502)))
async def unload_lora_adapter(request: Request[Any, Any, Any], state: State) -> engine_admin.UnloadedAdapter:
    """The engine unloads the adapter; its files stay cached until evicted."""
    agent: AgentRuntime = state.agent
    return await agent.adapters.unload(decode_body(await request.body(), engine_admin.UnloadLoRAAdapterRequest))


@get("/v1/lora_adapters", guards=[admin_guard], operation_id="listLoraAdapters",
     opt=route_doc(response=engine_admin.AdapterList, errors=(401, 403, 502)))
async def list_lora_adapters(state: State) -> engine_admin.AdapterList:
    """What the engine serves, as it says it now (residency `loaded`)."""
    agent: AgentRuntime = state.agent
    return await agent.adapters.list()


@get("/v1/lora_stats", guards=[admin_guard], operation_id="loraStats",
     opt=route_doc(response=engine_admin.LoraStats, errors=(401, 403, 502)))
async def lora_stats(state: State) -> engine_admin.LoraStats:
    """Requests and tokens by served name where the engine labels them, and the agent's load figures."""
    agent: AgentRuntime = state.agent
    return await agent.adapters.stats()


@get("/health", operation_id="health", opt=route_doc(errors=(503,)))
async def health(state: State) -> Response[dict[str, Any]]:
    """200 while the engine answers its health check; 503 with the reason otherwise."""
    watch = state.agent.watch
    if watch.healthy:
        return Response({"status": "ok"}, status_code=200)
    return Response({"status": "unhealthy", "reason": watch.dead_reason}, status_code=503)


@get("/metrics", operation_id="metrics",
     opt=route_doc(media_type=CONTENT_TYPE_LATEST.split(";")[0], response_description="Prometheus text exposition."))
async def metrics(state: State) -> Response[bytes]:
    """The agent's view: whether its engine is healthy, the adapters it serves, the cache's bytes."""
    agent: AgentRuntime = state.agent
    registry = CollectorRegistry()
    Gauge("loraplane_agent_engine_healthy", "1 while the engine answers its health check",
          registry=registry).set(int(agent.watch.healthy))
    Gauge("loraplane_agent_adapters_served", "adapters the engine served at the last look",
          registry=registry).set(agent.adapters.served_count)
    Gauge("loraplane_agent_cache_bytes", "bytes of adapter versions in --adapter-dir",
          registry=registry).set(agent.cache.size_bytes)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def create_app(agent: AgentRuntime) -> Litestar:
    app = Litestar(
        route_handlers=[load_lora_adapter, unload_lora_adapter, list_lora_adapters, lora_stats, health, metrics],
        state=State({"agent": agent}), on_startup=[agent.start], on_shutdown=[agent.stop],
        exception_handlers=exception_handlers(), request_max_body_size=MAX_BODY_BYTES, logging_config=None)
    document_app(app)
    return app
