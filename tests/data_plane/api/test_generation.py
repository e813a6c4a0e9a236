"""Generation lifecycle over a scripted engine: closing early aborts, metrics count each request once."""

from __future__ import annotations

import asyncio

import pytest

from data_plane.api.generation import MergedGenerations, start_all, start_generation
from data_plane.engine.sampling_params import SamplingParams
from data_plane.engine.sequence import Request
from data_plane.metrics import EngineMetrics
from shared.errors import InvalidRequestError, OverloadedError
from tests.data_plane.api.fakes import FakeEngine, sample_sum


def request(request_id: str, max_tokens: int = 5, prompt: list[int] | None = None) -> Request:
    return Request(request_id, prompt or [1, 2, 3], SamplingParams(max_tokens=max_tokens))


def outcomes(metrics: EngineMetrics) -> dict[str, float]:
    return {
        o: sample_sum(metrics.registry, "loraplane_requests_total", outcome=o)
        for o in ("ok", "error", "abort", "rejected")
    }


async def test_full_run_is_ok_and_counts_tokens():
    engine, metrics = FakeEngine(), EngineMetrics()
    generation = await start_generation(engine, request("r1"), metrics.start_request())
    outputs = [o async for o in generation]
    await generation.aclose()
    assert outputs[-1].finished and len(outputs) == 5
    assert engine.aborted == []
    assert outcomes(metrics)["ok"] == 1
    assert sample_sum(metrics.registry, "loraplane_generation_tokens_total") == 5
    assert sample_sum(metrics.registry, "loraplane_prompt_tokens_total") == 3
    assert metrics.registry.get_sample_value("loraplane_inter_token_latency_seconds_count") == 4


async def test_closing_early_aborts_the_engine_request():
    engine, metrics = FakeEngine(), EngineMetrics()
    generation = await start_generation(engine, request("r1"), metrics.start_request())
    await anext(generation)
    await generation.aclose()
    await generation.aclose()  # idempotent
    assert engine.aborted == ["r1"]
    assert outcomes(metrics) == {"ok": 0, "error": 0, "abort": 1, "rejected": 0}


async def test_cancelled_consumer_aborts():
    engine, metrics = FakeEngine(step_delay=0.05), EngineMetrics()

    async def consume() -> None:
        generation = await start_generation(engine, request("r1", max_tokens=50), metrics.start_request())
        try:
            async for _ in generation:
                pass
        finally:
            await generation.aclose()

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.aborted == ["r1"] and outcomes(metrics)["abort"] == 1


@pytest.mark.parametrize(
    ("engine", "exc"),
    [(FakeEngine(overloaded=True), OverloadedError), (FakeEngine(), InvalidRequestError)],
)
async def test_refused_on_admission_is_rejected(engine, exc):
    metrics = EngineMetrics()
    max_tokens = 5 if engine.overloaded else 1000  # else: longer than the context
    with pytest.raises(exc):
        await start_generation(engine, request("r1", max_tokens=max_tokens), metrics.start_request())
    assert outcomes(metrics)["rejected"] == 1
    assert sample_sum(metrics.registry, "loraplane_e2e_request_latency_seconds_count") == 0


async def test_merged_generations_interleave_and_close_all():
    engine, metrics = FakeEngine(), EngineMetrics()
    generations = await start_all(engine, [(request(f"r{i}"), metrics.start_request(), None) for i in range(3)])
    merged = MergedGenerations(generations)
    seen = [index async for index, _ in merged]
    await merged.aclose()
    assert sorted(seen) == [0] * 5 + [1] * 5 + [2] * 5
    assert outcomes(metrics)["ok"] == 3

    merged = MergedGenerations(
        await start_all(engine, [(request(f"s{i}", 50), metrics.start_request(), None) for i in range(2)])
    )
    await anext(merged)
    await merged.aclose()
    assert sorted(engine.aborted) == ["s0", "s1"]


async def test_start_all_closes_the_started_ones_when_one_is_refused():
    engine, metrics = FakeEngine(), EngineMetrics()
    with pytest.raises(InvalidRequestError):
        await start_all(
            engine,
            [(request("ok"), metrics.start_request(), None), (request("bad", 1000), metrics.start_request(), None)],
        )
    assert engine.aborted == ["ok"]
    assert outcomes(metrics)["rejected"] == 1 and outcomes(metrics)["abort"] == 1
