"""LoRA admin endpoints (vLLM-compatible names): thin controllers over LoRAService.

Mutating endpoints sit behind the admin guard (--admin-token). Without --enable-lora every one of
them answers 400 saying how to turn LoRA on. Each route's `route_doc` (shared.openapi) is its contract:
the request and reply structs and every status it can answer, all errors in the OpenAI shape.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, get, post
from litestar.datastructures import State

from data_plane.api.auth import admin_guard, is_admin, listing_guard
from data_plane.api.serving_lora import LoRAService, decode_admin_request
from shared import engine_admin
from shared.engine_admin import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from shared.openapi import route_doc

# 400: a malformed body, or LoRA off; 401/403: the admin token (when the engine has one); 413: body size
_ADMIN_ERRORS = (400, 401, 403, 413)


@post(
    "/v1/load_lora_adapter", status_code=200, guards=[admin_guard], operation_id="loadLoraAdapter",
    opt=route_doc(request=LoadLoRAAdapterRequest, response=engine_admin.LoadedAdapter,
                  # 409: other content under the name without load_inplace, files that are not
                  # `expected_sha256` (code sha256_mismatch), or every slot pinned; 502: an `artifact`
                  # could not be fetched (worth a retry); 503: shutting down, the engine loop is not
                  # running, or the artifact cache is full of adapters in use
                  errors=(*_ADMIN_ERRORS, 409, 502, 503)),
)
async def load_lora_adapter(request: Request[Any, Any, Any], state: State) -> engine_admin.LoadedAdapter:
    """Load a PEFT adapter (idempotent for the same content; `load_inplace` replaces changed content,
    the old version draining; `pinned` keeps it in a device slot). With `expected_sha256` (the
    version's manifest digest) other files are refused with 409 `sha256_mismatch` and nothing loads.
    With `artifact` instead of `lora_path` the engine fetches the version from its control plane (or
    the store endpoint) by digest, checks every file's sha256 (400 `checksum_mismatch` otherwise) and
    keeps it in its cache (--lora-cache-dir): a cached digest is never fetched again."""
    body = decode_admin_request(await request.body(), LoadLoRAAdapterRequest)
    lora: LoRAService = state.lora
    return await lora.load(body)


@post(
    "/v1/unload_lora_adapter", status_code=200, guards=[admin_guard], operation_id="unloadLoraAdapter",
    opt=route_doc(request=UnloadLoRAAdapterRequest, response=engine_admin.UnloadedAdapter,
                  errors=(*_ADMIN_ERRORS, 404)),  # 404: no adapter of that name is loaded
)
async def unload_lora_adapter(request: Request[Any, Any, Any], state: State) -> engine_admin.UnloadedAdapter:
    """Unload an adapter: refuse new requests, let in-flight ones finish within `drain_timeout_s`
    (then abort them), free its device slot and host copy."""
    body = decode_admin_request(await request.body(), UnloadLoRAAdapterRequest)
    lora: LoRAService = state.lora
    return await lora.unload(body)


@get("/v1/lora_adapters", operation_id="listLoraAdapters", guards=[listing_guard],
     opt=route_doc(response=engine_admin.AdapterList, errors=(400,)))
async def list_lora_adapters(request: Request[Any, Any, Any], state: State) -> engine_admin.AdapterList:
    """Loaded adapters with residency (device/host/disk), state, pin, queues; plus device slot usage.
    `path` (where the files lie on the engine) is shown to admin callers only (null otherwise)."""
    lora: LoRAService = state.lora
    return lora.list(show_paths=is_admin(request))


@get("/v1/lora_stats", operation_id="loraStats", guards=[listing_guard], opt=route_doc(response=engine_admin.LoraStats, errors=(400,)))
async def lora_stats(state: State) -> engine_admin.LoraStats:
    """Per adapter: requests by outcome, tokens, TTFT and end-to-end p50/p99, tokens/s over the last
    minute, slot loads, evictions and load latency."""
    lora: LoRAService = state.lora
    return lora.stats()


ROUTES = [load_lora_adapter, unload_lora_adapter, list_lora_adapters, lora_stats]
