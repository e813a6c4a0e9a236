"""EngineProtocol: everything the API layer may call on an engine, and the types it answers with.

The HTTP services, the app factory, the control-plane client and the shutdown code are typed against
this protocol, never against `Any`. Two engines implement it: EngineCoreClient (data_plane/engine/
core/client.py, the default: the engine core in its own process) and AsyncLLMEngine (the engine on a
thread of the API process, --no-engine-core-process); tests/data_plane/engine/test_protocol.py and
tests/data_plane/engine/core/test_client.py check each member's signature against this one. A test
double, where one is still needed, implements it too and is checked against the real engine for the
cases both can run.

Two narrower protocols name what a part needs and nothing more: `EngineHealth` (the control-plane
heartbeat) and `LoRAEngine` (the adapter registry, data_plane/adapters/registry.py); EngineProtocol is
both, plus generation and the lifecycle.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

from data_plane.adapters.registry import LoRAEngine
from data_plane.config import EngineConfig
from data_plane.engine.llm_engine import EngineStats
from data_plane.engine.outputs import RequestOutput
from data_plane.engine.sequence import Request
from data_plane.engine.streams import RequestStream
from data_plane.lora.weights import LoRAAdapterWeights
from data_plane.tokenizer import Tokenizer

__all__ = ["EngineHealth", "EngineProtocol", "EngineStats", "LoRAEngine"]


class EngineHealth(Protocol):
    """What a heartbeat reports: whether the step loop runs, why not, and the engine's figures."""

    healthy: bool  # False once the step loop has died; it never comes back
    dead_reason: str | None  # a generic reason once dead (the log has the detail), None while healthy

    def stats(self) -> EngineStats:
        """The figures of the last step (queues, KV blocks, prefix cache, LoRA slots); never blocks."""
        ...


class EngineProtocol(EngineHealth, LoRAEngine, Protocol):
    config: EngineConfig  # finalized: max_model_len and max_prompt_chars are set
    tokenizer: Tokenizer
    vocab_size: int  # the model's: prompt token ids must be below it

    def start(self) -> None:
        """Start the step loop; call inside the event loop that will consume the outputs."""
        ...

    async def shutdown(self) -> None: ...

    def submit(self, requests: list[Request]) -> list[RequestStream]:
        """Admit the engine requests of one API request together, all or none (admission.py): a refusal
        (400 it can never fit, 503 not now, engine dead) raises here, before any of them reaches the
        engine's core, which then adds them whole or refuses them whole (each stream raises). Each
        stream yields its request's outputs, one per step, the last one `finished`; close every stream,
        iterated or not: closing one before its end aborts its request."""
        ...

    def generate(self, request: Request) -> AsyncGenerator[RequestOutput, None]:
        """`submit` of one request as a generator: refusals raise at the first `anext`; closing the
        generator before the end aborts the request."""
        ...

    def abort(self, request_id: str) -> None:
        """End the request at the next step (its stream then gets a finished `abort` output)."""
        ...

    def stats(self) -> EngineStats: ...

    def num_requests(self) -> int:
        """Requests this API process has sent that have not finished: current at once, unlike the
        queues in `stats()`, which are those of the last step."""
        ...

    async def pin_lora(self, adapter_id: int, weights: LoRAAdapterWeights) -> None:
        """Copy the adapter into a device slot now and keep it there; 409 when every slot is pinned or busy."""
        ...

    async def unpin_lora(self, adapter_id: int) -> None: ...

    async def remove_lora(self, adapter_id: int) -> None:
        """Free the adapter's slot; the caller makes sure none of its requests is still in flight."""
        ...
