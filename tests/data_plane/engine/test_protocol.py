"""AsyncLLMEngine implements EngineProtocol, member by member; the checker catches a drifted double."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from pathlib import Path

from data_plane.adapters.registry import LoRAEngine
from data_plane.engine.async_engine import AsyncLLMEngine
from data_plane.engine.outputs import RequestOutput
from data_plane.engine.protocol import EngineHealth, EngineProtocol, EngineStats
from data_plane.engine.sequence import Request
from tests.data_plane.api.engines import make_engine
from tests.data_plane.engine.protocol_check import mismatches, protocol_members


def test_the_async_engine_implements_the_protocol(demo_model_dir: Path):
    for lora in (False, True):
        engine = make_engine(demo_model_dir, enable_lora=lora)
        assert mismatches(engine, EngineProtocol) == []
        # the typed stats are what the protocol promises, LoRA on or off
        stats = engine.stats()
        assert type(stats) is EngineStats and stats.lora.slots_total == (4 if lora else 0)


def test_the_protocol_names_what_the_api_calls():
    members = set(protocol_members(EngineProtocol))
    assert members == {
        "config", "tokenizer", "vocab_size", "healthy", "dead_reason", "start", "shutdown", "submit", "generate", "abort",
        "stats", "num_requests", "pin_lora", "unpin_lora", "remove_lora",
    }
    assert set(protocol_members(EngineHealth)) <= members and set(protocol_members(LoRAEngine)) <= members


def test_the_checker_catches_a_double_that_drifted(demo_model_dir: Path):
    class Drifted(AsyncLLMEngine):
        def pin_lora(self, adapter_id: int, weights: object) -> None:  # sync, and loosely typed
            pass

        async def generate(self, request: Request, priority: int = 0) -> AsyncGenerator[RequestOutput, None]:
            yield  # type: ignore[misc]

    drifted = Drifted(make_engine(demo_model_dir).engine)
    drifted.dead_reason = 3  # type: ignore[assignment]
    del drifted.healthy
    problems = " | ".join(mismatches(drifted, EngineProtocol))
    assert "healthy: missing" in problems and "dead_reason: int" in problems
    assert "pin_lora: async-ness" in problems and "pin_lora: annotations" in problems
    assert "generate: parameters" in problems
