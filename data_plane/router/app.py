"""The router's HTTP app: OpenAI's inference routes in front of the engines, /v1/models, /health, /metrics.

Thin handlers over RouterService (service.py). Every error, Litestar's own included (unknown route, a body
over the size limit), leaves in OpenAI's shape (shared/http_errors.py). With client keys configured
(LORAPLANE_API_KEYS) the inference routes and the model list need one; with --require-api-key a static
key or a tenant key (tenancy.py), and the model list shows a tenant key what it may use; /health and
/metrics stay open.

The two inference routes are the hot path, and Litestar's per-request machinery (request object, guards,
kwargs, response object) costs more than the proxying itself (docs/performance.md#router-and-fleet;
measure with bench/router_overhead.py). Litestar still
routes them and documents them from their handlers, but `fast_path`, the handlers' own ASGI middleware,
answers them from the raw ASGI messages (RouterService.complete, which checks the client key itself) and
the handler bodies never run. Errors it raises before answering go through the app's exception handlers
like any other.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any, Literal, NoReturn

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.handlers import HTTPRouteHandler
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.types import ASGIApp, Receive, Scope, Send

from data_plane.router.config import RouterConfig
from data_plane.router.errors import model_not_found
from data_plane.router.keys import OPERATOR, Caller
from data_plane.router.metrics import CONTENT_TYPE
from data_plane.router.service import RouterService
from shared.http_errors import exception_handlers
from shared.openapi import document_app, route_doc

try:
    __version__ = version("loraplane")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"


# text, texts, token ids or lists of them (msgspec documents one array type: their items' union)
Prompt = str | Annotated[list[str | int | list[int]], msgspec.Meta(min_length=1)]


ModelName = Annotated[str, msgspec.Meta(min_length=1)]  # an empty one is a 400 naming `model`


class RoutedCompletionRequest(msgspec.Struct):
    """What the router documents of a completion request: what the engines require besides the fields the
    router reads (`model`, `stream`); every other field goes to the engine as sent."""

    model: ModelName  # a base model's served name or an adapter's name
    prompt: Prompt  # required: an engine answers 400 without it
    stream: bool = False


class RoutedChatRequest(msgspec.Struct):
    """A chat request as the router documents it (see RoutedCompletionRequest)."""

    model: ModelName
    messages: Annotated[list[dict[str, Any]], msgspec.Meta(min_length=1)]  # required, as by the engines
    stream: bool = False


class ModelCard(msgspec.Struct):
    id: str
    object: str
    created: int
    owned_by: str
    root: str
    parent: str | None  # an adapter's base model; null for a base model


class ModelList(msgspec.Struct):
    object: str
    data: list[ModelCard]


class RoutingTableHealth(msgspec.Struct):
    etag: str | None
    age_s: float
    engines: int
    models: int


class QuotaHealth(msgspec.Struct):
    redis: Literal["ok", "unreachable", "unknown", "unconfigured"]
    on_failure: Literal["closed", "open"]  # what requests with quotas get while Redis is unreachable
    error: str | None = None


class TenancyHealth(msgspec.Struct):
    require_api_key: bool
    quotas: QuotaHealth
    revocations: Literal["subscribed", "not subscribed"]


class Health(msgspec.Struct):
    status: str  # ok | degraded (the control plane has not confirmed the table lately, or Redis is down)
    routing_table: RoutingTableHealth
    reason: str | None = None
    tenancy: TenancyHealth | None = None  # with --require-api-key


async def client_key_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """The caller (keys.py), kept in the request's state for the model list to filter by."""
    client = connection.client.host if connection.client else ""
    caller = await connection.app.state.router.tenancy.caller(connection.headers.get("authorization"), client)
    connection.scope.setdefault("state", {})["loraplane_caller"] = caller


def _caller(request: Request[Any, Any, Any]) -> Caller:
    caller: Caller = request.scope.get("state", {}).get("loraplane_caller", OPERATOR)  # client_key_guard's
    return caller


_ERRORS = (400, 404, 413, 502, 503)
_PASSED = "The engine's answer as it sent it (JSON, or text/event-stream when `stream`), with x-loraplane-engine."


def fast_path(app: ASGIApp) -> ASGIApp:  # noqa: ARG001 (Litestar passes the handler it wraps)
    """The inference handlers' middleware: RouterService.complete answers, the handler is never called."""

    async def complete(scope: Scope, receive: Receive, send: Send) -> None:
        await scope["app"].state.router.complete(scope, receive, send)

    return complete


def _served_by_fast_path() -> NoReturn:
    raise AssertionError("the inference routes are answered by fast_path, before their handler")


@post("/v1/chat/completions", status_code=200, operation_id="createChatCompletion", guards=[client_key_guard],
      middleware=[fast_path],
      opt=route_doc(request=RoutedChatRequest, errors=_ERRORS, response_description=_PASSED,
                    example={"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}))
async def create_chat_completion() -> Response[Any]:
    """Create a chat completion on an engine that holds `model` (OpenAI-compatible; `stream` for SSE)."""
    _served_by_fast_path()


@post("/v1/completions", status_code=200, operation_id="createCompletion", guards=[client_key_guard],
      middleware=[fast_path],
      opt=route_doc(request=RoutedCompletionRequest, errors=_ERRORS, response_description=_PASSED,
                    example={"model": "demo", "prompt": "Once upon a time", "max_tokens": 8}))
async def create_completion() -> Response[Any]:
    """Create a completion on an engine that holds `model` (OpenAI-compatible; `stream` for SSE)."""
    _served_by_fast_path()


@get("/v1/models", operation_id="listModels", guards=[client_key_guard], opt=route_doc(response=ModelList))
async def list_models(state: State, request: Request[Any, Any, Any]) -> dict[str, Any]:
    """The fleet's base models and active adapters (`parent`: an adapter's base model), from the routing
    table; for a tenant key, only those it may use (the base models, its tenant's and public adapters)."""
    return {"object": "list", "data": state.router.cards(_caller(request))}


@get("/v1/models/{model_id:path}", operation_id="retrieveModel", guards=[client_key_guard],
     opt=route_doc(response=ModelCard, errors=[404]))
async def retrieve_model(model_id: str, state: State, request: Request[Any, Any, Any]) -> dict[str, Any]:
    """One model of the routing table by name (404 when the fleet has no such model, or the key may not use it)."""
    name = model_id.lstrip("/")
    router: RouterService = state.router
    card = next((c for c in router.cards(_caller(request)) if c["id"] == name), None)
    if card is None:
        raise model_not_found(name)
    return card


@get("/health", operation_id="health", opt=route_doc(response=Health, errors=[503]))
async def health(state: State) -> Response[Any]:
    """200 `ok`; 200 `degraded` while the control plane has not confirmed the routing table for a while (the
    router routes by the last one); 503 before the first table."""
    status, body = state.router.health()
    return Response(body, status_code=status)


@get("/metrics", operation_id="metrics",
     opt=route_doc(media_type=CONTENT_TYPE.split(";")[0], response_description="Prometheus text exposition."))
async def metrics(state: State) -> Response[bytes]:
    """Prometheus exposition of this router's metrics."""
    return Response(state.router.metrics.render(), media_type=CONTENT_TYPE)


def _key_errors(config: RouterConfig, handler: HTTPRouteHandler) -> list[int]:
    """What keys add to a guarded route: 401 (no or a wrong key); with --require-api-key also 403 (a key
    without the inference scope) and 429 (too many failed key attempts; on the inference routes, a quota)."""
    if client_key_guard not in (handler.guards or ()) or not (config.api_keys or config.require_api_key):
        return []
    return [401, 403, 429] if config.require_api_key else [401]


def create_app(config: RouterConfig) -> Litestar:
    service = RouterService(config)
    app = Litestar(
        route_handlers=[create_chat_completion, create_completion, list_models, retrieve_model, health, metrics],
        state=State({"router": service}),
        on_startup=[service.start],
        on_shutdown=[service.stop],
        exception_handlers=exception_handlers(),
        request_max_body_size=config.max_request_body_bytes,
        openapi_config=OpenAPIConfig(title="loraplane router", version=__version__),
        logging_config=None,  # the process configures logging at its edge (cli.py)
    )
    document_app(app, extra_errors=lambda h: _key_errors(config, h))
    return app
