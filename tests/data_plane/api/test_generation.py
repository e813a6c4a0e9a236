"""Generation lifecycle over a real engine on the demo checkpoint: closing early aborts the engine's
request, metrics count each request once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from data_plane.api.generation import MergedGenerations, start_all, start_generation
from data_plane.engine.async_engine import AsyncLLMEngine
from data_plane.engine.sequence import Request
from data_plane.metrics import EngineMetrics
from shared.errors import InvalidRequestError, OverloadedError
from tests.data_plane.api.engines import greedy, make_engine, sample_sum, stalled


@pytest.fixture
async def engine(demo_model_dir: Path) -> AsyncIterator[AsyncLLMEngine]:
    engine = make_engine(demo_model_dir, max_waiting_requests=1, max_n=1)
    engine.start()
    yield engine
    await engine.shutdown()


def request(request_id: str, max_tokens: int = 5, prompt: list[int] | None = None) -> Request:
    return Request(request_id, prompt or [1, 2, 3], greedy(max_tokens))


def outcomes(metrics: EngineMetrics) -> dict[str, float]:
    return {
        o: sample_sum(metrics.registry, "loraplane_requests_total", outcome=o)
        for o in ("ok", "error", "abort", "rejected")
    }


async def gone(engine: AsyncLLMEngine, *request_ids: str) -> bool:
    """Whether the engine has dropped these requests (an abort takes effect at its next step)."""
    for _ in range(200):
        if not any(r in engine.engine.requests for r in request_ids):
            return True
        await asyncio.sleep(0.01)
    return False


async def test_full_run_is_ok_and_counts_tokens(engine):
    metrics = EngineMetrics()
    generation = await start_generation(engine, request("r1"), metrics.start_request())
    outputs = [o async for o in generation]
    await generation.aclose()
    assert outputs[-1].finished and sum(len(d.token_ids) for o in outputs for d in o.deltas) == 5
    assert all(d.finish_reason != "abort" for o in outputs for d in o.deltas)
    assert outcomes(metrics)["ok"] == 1
    assert sample_sum(metrics.registry, "loraplane_generation_tokens_total") == 5
    assert sample_sum(metrics.registry, "loraplane_prompt_tokens_total") == 3
    itl = metrics.registry.get_sample_value("loraplane_inter_token_latency_seconds_count")
    assert itl == len(outputs) - 1  # one gap between consecutive outputs


async def test_closing_early_aborts_the_engine_request(engine):
    metrics = EngineMetrics()
    generation = await start_generation(engine, request("r1", max_tokens=50), metrics.start_request())
    await anext(generation)
    await generation.aclose()
    await generation.aclose()  # idempotent
    assert await gone(engine, "r1")
    assert outcomes(metrics) == {"ok": 0, "error": 0, "abort": 1, "rejected": 0}


async def test_cancelled_consumer_aborts(engine):
    metrics = EngineMetrics()
    first = asyncio.Event()

    async def consume() -> None:
        generation = await start_generation(engine, request("r1", max_tokens=50), metrics.start_request())
        try:
            async for _ in generation:
                first.set()
                await asyncio.sleep(0.01)  # a slow reader: the request is still running when cancelled
        finally:
            await generation.aclose()

    task = asyncio.ensure_future(consume())
    await first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await gone(engine, "r1") and outcomes(metrics)["abort"] == 1


async def test_refused_when_overloaded_is_rejected(engine, monkeypatch):
    metrics = EngineMetrics()
    with stalled(engine, monkeypatch, step_s=0.2):  # "first" stays queued: the one waiting place is taken
        first = engine.generate(request("first"))
        pending = asyncio.ensure_future(anext(first))
        await asyncio.sleep(0)
        with pytest.raises(OverloadedError):
            await start_generation(engine, request("r1"), metrics.start_request())
        await pending
        await first.aclose()
    assert outcomes(metrics)["rejected"] == 1
    assert sample_sum(metrics.registry, "loraplane_e2e_request_latency_seconds_count") == 0


async def test_refused_as_invalid_is_rejected(engine):
    metrics = EngineMetrics()
    with pytest.raises(InvalidRequestError):  # longer than the context
        await start_generation(engine, request("r1", max_tokens=1000), metrics.start_request())
    assert outcomes(metrics)["rejected"] == 1
    assert sample_sum(metrics.registry, "loraplane_e2e_request_latency_seconds_count") == 0


async def test_merged_generations_interleave_and_close_all(demo_model_dir):
    engine, metrics = make_engine(demo_model_dir), EngineMetrics()
    engine.start()
    try:
        generations = await start_all(engine, [(request(f"r{i}"), metrics.start_request(), None) for i in range(3)])
        merged = MergedGenerations(generations)
        seen = [(index, sum(len(d.token_ids) for d in output.deltas)) async for index, output in merged]
        await merged.aclose()
        assert {i: sum(n for j, n in seen if j == i) for i in range(3)} == {0: 5, 1: 5, 2: 5}
        assert outcomes(metrics)["ok"] == 3

        merged = MergedGenerations(
            await start_all(engine, [(request(f"s{i}", 50), metrics.start_request(), None) for i in range(2)])
        )
        await anext(merged)
        await merged.aclose()
        assert await gone(engine, "s0", "s1") and outcomes(metrics)["abort"] == 2
    finally:
        await engine.shutdown()


async def test_start_all_refuses_the_group_whole_before_any_of_it_reaches_the_engine(engine):
    metrics = EngineMetrics()
    with pytest.raises(InvalidRequestError):
        await start_all(
            engine,
            [(request("ok", 50), metrics.start_request(), None), (request("bad", 1000), metrics.start_request(), None)],
        )
    assert engine.num_requests() == 0
    assert engine.engine.num_steps == 0 and not engine.engine.has_work()
    assert outcomes(metrics) == {"ok": 0, "error": 0, "abort": 0, "rejected": 2}
