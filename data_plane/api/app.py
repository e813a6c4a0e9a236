"""The engine's HTTP app: thin OpenAI-compatible controllers over the serving services.

Every error, including Litestar's own (unknown route, oversized body), leaves as an OpenAI-style
body `{"error": {"message", "type", "param", "code"}}`; see errors.py.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

from litestar import Litestar, Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig
from litestar.response import Stream

from data_plane.adapters.artifact_source import ArtifactSource, artifact_cache_for
from data_plane.adapters.artifacts.metrics import ArtifactCollector
from data_plane.adapters.loading.reader_process import AdapterReaderProcess
from data_plane.adapters.loading.reader_process_metrics import AdapterReaderCollector
from data_plane.adapters.loading.spec import AdapterReading
from data_plane.adapters.registry import Loader, LoRARegistry
from data_plane.adapters.stats import AdapterRequestStats
from data_plane.api import lora_routes, schemas
from data_plane.api.auth import api_key_guard, is_admin, listing_guard, models_guard
from data_plane.api.models import ModelResolver
from data_plane.api.protocol import decode_request, request_types
from data_plane.api.serving_chat import ChatService
from data_plane.api.serving_completion import CompletionService
from data_plane.api.serving_lora import LoRAService
from data_plane.api.streaming import EventStream
from data_plane.config import EngineConfig
from data_plane.engine.protocol import EngineProtocol
from data_plane.metrics import CONTENT_TYPE, EngineMetrics, GrammarCacheCollector
from data_plane.structured.compiler import GrammarCompiler
from shared.disconnect import until_disconnect
from shared.errors import EngineDeadError, LoraplaneError
from shared.http_errors import exception_handlers
from shared.openapi import document_app, route_doc

T = TypeVar("T")
logger = logging.getLogger(__name__)

try:
    __version__ = version("loraplane")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"


async def _until_disconnect(request: Request[Any, Any, Any], work: Awaitable[T]) -> T:
    """Run `work`, cancelling it if the client goes away first: the engine then aborts the request
    instead of generating an answer nobody reads. (Streams watch for this themselves later on.)"""
    return await until_disconnect(request.receive, work)


def _respond(result: dict[str, Any] | EventStream) -> Response[Any]:
    if isinstance(result, EventStream):
        return Stream(
            result.body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            background=BackgroundTask(result.aclose),  # runs however the stream ended
        )
    return Response(result)


# what an inference request can be answered with besides 200 (401 is added where --api-key is set)
_GENERATION_ERRORS = (400, 404, 413, 500, 503)


_EXAMPLES = {
    "chat": {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 8},
    "completion": {"prompt": "Once upon a time", "max_tokens": 8},
}


def _generation_route(path: str, operation_id: str, kind: str, response: type, chunk: type) -> post:
    """POST route of a generation endpoint; its request type is this engine's (protocol.request_types)."""
    doc = route_doc(
        request=lambda app: getattr(app.state.request_types, kind),
        response=response,
        stream=chunk,
        errors=_GENERATION_ERRORS,
        example=lambda app: {"model": app.state.resolver.served_model_name, **_EXAMPLES[kind]},
    )
    return post(path, status_code=200, operation_id=operation_id, guards=[api_key_guard], opt=doc)


@_generation_route(
    "/v1/chat/completions", "createChatCompletion", "chat", schemas.ChatCompletion, schemas.ChatCompletionChunk
)
async def create_chat_completion(request: Request[Any, Any, Any], state: State) -> Response[Any]:
    """Create a model response for a chat conversation (OpenAI-compatible; `stream` for SSE)."""
    body = decode_request(await request.body(), state.request_types.chat)
    return _respond(await _until_disconnect(request, state.chat.create(body)))


@_generation_route("/v1/completions", "createCompletion", "completion", schemas.Completion, schemas.CompletionChunk)
async def create_completion(request: Request[Any, Any, Any], state: State) -> Response[Any]:
    """Create a completion for a prompt (OpenAI-compatible legacy completions; `stream` for SSE)."""
    body = decode_request(await request.body(), state.request_types.completion)
    return _respond(await _until_disconnect(request, state.completion.create(body)))


@get("/v1/models", operation_id="listModels", guards=[models_guard], opt=route_doc(response=schemas.ModelList))
async def list_models(request: Request[Any, Any, Any], state: State) -> dict[str, Any]:
    """List the models this engine serves: the base model and every ready adapter (`parent` = base).
    `root` is where the model's files lie for admin callers (as in vLLM), the model's name otherwise."""
    return {"object": "list", "data": state.resolver.cards(show_paths=is_admin(request))}


@get(
    "/v1/models/{model_id:path}",
    operation_id="retrieveModel",
    guards=[models_guard],
    opt=route_doc(response=schemas.ModelCard, errors=[404]),
)
async def retrieve_model(model_id: str, request: Request[Any, Any, Any], state: State) -> dict[str, Any]:
    """One served model by name (404 when this engine does not serve it); `root` as in listModels."""
    resolver: ModelResolver = state.resolver
    return resolver.card(model_id.lstrip("/"), show_paths=is_admin(request))  # :path keeps names with slashes ("org/adapter")


@get("/health", operation_id="health", opt=route_doc(response=schemas.Health, errors=[503]))
async def health(state: State) -> Response[Any]:
    """200 while the engine loop runs; 503 with the reason once it has died."""
    engine: EngineProtocol = state.engine
    if engine.healthy:
        return Response({"status": "ok"})
    error = EngineDeadError(f"The engine is not running: {engine.dead_reason}")
    return Response(error.to_body(), status_code=error.status_code)


@get(
    "/metrics",
    operation_id="metrics",
    opt=route_doc(media_type=CONTENT_TYPE.split(";")[0], response_description="Prometheus text exposition."),
)
async def metrics(state: State) -> Response[bytes]:
    """Prometheus exposition of this engine's metrics."""
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@get("/version", operation_id="version", opt=route_doc(response=schemas.Version))
async def get_version() -> dict[str, str]:
    """The loraplane version of this engine."""
    return {"version": __version__}


def _has_requests(engine: EngineProtocol) -> bool:
    """Whether the engine is serving: background adapter work rests then."""
    return engine.num_requests() > 0


def _guard_errors(config: EngineConfig, guards: Sequence[object]) -> list[int]:
    """The statuses a route's guard adds to its document, with this engine's tokens."""
    listings_guarded = bool(config.admin_token or config.read_token)
    if listing_guard in guards and listings_guarded:
        return [401, 403]
    if api_key_guard in guards and config.api_key or models_guard in guards and (config.api_key or listings_guarded):
        return [401]
    return []


def create_app(engine: EngineProtocol, config: EngineConfig, *, lora_loader: Loader | None = None) -> Litestar:
    """engine: an EngineProtocol (EngineCoreClient or AsyncLLMEngine), not started: startup starts it
    inside the server's loop.
    lora_loader: how adapter folders are read (default: the PEFT loader for config's base model, in
    adapter reader processes from the first load on, unless config.adapter_reader_process is off)."""
    assert config.max_model_len is not None, "finalize the config (load the engine) first"
    assert config.max_n is not None and config.max_cpu_loras is not None  # set by EngineConfig.__post_init__
    base_name = config.served_model_name or config.model
    request_stats = AdapterRequestStats()
    registry = None
    reader_process = None  # the adapter reader processes, when adapter files are read in them
    artifacts = None  # versions named by digest: fetched from the control plane into the engine's cache
    if config.enable_lora:
        cache = artifact_cache_for(config, busy=lambda: _has_requests(engine))
        if lora_loader is None:
            reading = AdapterReading.of(config, cache_dir=str(cache.root))
            if config.adapter_reader_process:
                reader_process = AdapterReaderProcess(reading, cache.verified, busy=lambda: _has_requests(engine))
            lora_loader = reader_process or functools.partial(reading.read, verified=cache.verified)
        registry = LoRARegistry(
            engine,
            lora_loader,
            base_name=base_name,
            max_cpu_loras=config.max_cpu_loras,
            default_drain_timeout_s=config.default_drain_timeout_s,
            on_unloaded=request_stats.forget,
        )
        artifacts = ArtifactSource(registry, cache)
    resolver = ModelResolver(base_name, config.model, config.max_model_len, registry, artifacts=artifacts)
    engine_metrics = EngineMetrics(
        engine.stats,
        base_name=base_name,
        max_adapter_labels=config.max_adapter_labels,
        adapter_names=registry.name_of if registry is not None else None,
        request_stats=request_stats,
    )
    if registry is not None and engine_metrics.lora is not None:
        registry.before_remove = engine_metrics.lora.sync
    if artifacts is not None:
        engine_metrics.registry.register(ArtifactCollector(artifacts.cache))
    if reader_process is not None:
        engine_metrics.registry.register(AdapterReaderCollector(reader_process))
    grammars = GrammarCompiler(
        engine.tokenizer,
        engine.vocab_size,
        timeout_s=config.structured_output_compile_timeout,
        max_bytes=config.max_structured_output_bytes,
        cache_size=config.structured_output_cache_size,
    )
    engine_metrics.registry.register(GrammarCacheCollector(grammars))
    state = State(
        {
            "engine": engine,
            "config": config,
            "request_types": request_types(
                config.max_model_len,
                config.max_n,
                config.max_stop_strings,
                config.max_stop_string_length,
                engine.vocab_size,
            ),
            "resolver": resolver,
            "metrics": engine_metrics,
            "chat": ChatService(engine, resolver, engine_metrics, grammars),
            "completion": CompletionService(engine, resolver, engine_metrics, grammars),
            "lora": LoRAService(registry, engine, request_stats, base_name, artifacts),
        }
    )

    async def start_engine() -> None:
        engine.start()  # captures the running loop: the engine's outputs are handed back on it
        grammars.warm()
        if artifacts is not None:
            await artifacts.open()
        if reader_process is not None and config.lora_modules:
            # an engine started with adapters: its reader imports torch now, before traffic keeps the CPUs busy
            reader_process.start(import_first=True)
        if registry is not None:
            for name, path in config.lora_modules.items():  # --lora-modules: a failure stops the start
                try:
                    await registry.load(name, path)
                except LoraplaneError as exc:
                    logger.error("--lora-modules %s=%s cannot be loaded: %s", name, path, exc.message)
                    raise
                logger.info("preloaded adapter %s from %s", name, path)

    async def stop_engine() -> None:
        if registry is not None:
            await registry.close()
        if reader_process is not None:
            reader_process.close()
        if artifacts is not None:
            await artifacts.close()
        await engine.shutdown()

    app = Litestar(
        route_handlers=[
            create_chat_completion,
            create_completion,
            list_models,
            retrieve_model,
            health,
            metrics,
            get_version,
            *lora_routes.ROUTES,
        ],
        state=state,
        on_startup=[start_engine],
        on_shutdown=[stop_engine],
        exception_handlers=exception_handlers(),
        request_max_body_size=config.max_request_body_bytes,
        openapi_config=OpenAPIConfig(title="loraplane engine", version=__version__),
        logging_config=None,  # the process configures logging at its edge (server.py), not the app
    )
    document_app(app, extra_errors=lambda handler: _guard_errors(config, handler.guards or ()))
    return app
