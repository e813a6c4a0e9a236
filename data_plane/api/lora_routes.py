"""LoRA admin endpoints (vLLM-compatible names): thin controllers over LoRAService.

Mutating endpoints sit behind the admin guard (--admin-token). Without --enable-lora every one of
them answers 400 saying how to turn LoRA on.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, get, post
from litestar.datastructures import State

from data_plane.api.auth import admin_guard, check_admin
from data_plane.api.serving_lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, decode_admin_request
from shared.errors import LoraplaneError


@post("/v1/load_lora_adapter", status_code=200, guards=[admin_guard], operation_id="loadLoraAdapter")
async def load_lora_adapter(request: Request, state: State) -> dict[str, Any]:
    """Load a PEFT adapter (idempotent for the same content; `load_inplace` replaces changed content,
    the old version draining; `pinned` keeps it in a device slot)."""
    body = decode_admin_request(await request.body(), LoadLoRAAdapterRequest)
    return await state.lora.load(body)


@post("/v1/unload_lora_adapter", status_code=200, guards=[admin_guard], operation_id="unloadLoraAdapter")
async def unload_lora_adapter(request: Request, state: State) -> dict[str, Any]:
    """Unload an adapter: refuse new requests, let in-flight ones finish within `drain_timeout_s`
    (then abort them), free its device slot and host copy."""
    body = decode_admin_request(await request.body(), UnloadLoRAAdapterRequest)
    return await state.lora.unload(body)


@get("/v1/lora_adapters", operation_id="listLoraAdapters")
async def list_lora_adapters(request: Request, state: State) -> dict[str, Any]:
    """Loaded adapters with residency (device/host/disk), state, pin, queues; plus device slot usage.
    `path` (where the files lie on the engine) is shown to admin callers only."""
    return state.lora.list(show_paths=_is_admin(request))


def _is_admin(request: Request) -> bool:
    try:
        check_admin(request.headers.get("authorization"), request.app.state.config.admin_token)
    except LoraplaneError:
        return False
    return True


@get("/v1/lora_stats", operation_id="loraStats")
async def lora_stats(state: State) -> dict[str, Any]:
    """Per adapter: requests by outcome, tokens, TTFT and end-to-end p50/p99, tokens/s over the last
    minute, slot loads, evictions and load latency."""
    return state.lora.stats()


ROUTES = [load_lora_adapter, unload_lora_adapter, list_lora_adapters, lora_stats]
