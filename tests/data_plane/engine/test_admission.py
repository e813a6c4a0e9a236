"""Admission on a real engine: a request is added whole or not at all, a failure outside a batch
never kills the loop, the engine's limits (n, stop strings, waiting sequences) hold."""

from __future__ import annotations

import asyncio

import pytest

from data_plane.config import ConfigError
from data_plane.engine import llm_engine
from data_plane.engine.async_engine import AsyncLLMEngine
from data_plane.engine.sampling_params import SamplingParams
from data_plane.engine.sequence import Request, Sequence
from shared.errors import EngineDeadError, InvalidRequestError, LoraplaneError, OverloadedError
from tests.data_plane.engine.conftest import greedy, make_engine, run


def test_a_request_refused_while_building_its_sequences_leaves_nothing_queued(engine_checkpoints, monkeypatch):
    engine = make_engine(engine_checkpoints["qwen2"])

    def second_fails(seq_id: int, request: Request, index: int) -> Sequence:
        if index == 1:
            raise RuntimeError("cannot build sample 1")
        return Sequence(seq_id, request, index)

    monkeypatch.setattr(llm_engine, "Sequence", second_fails)
    with pytest.raises(RuntimeError):
        engine.add_request(Request("half", [5, 6, 7], greedy(4, n=2)))
    assert not engine.has_work() and engine.requests == {}
    monkeypatch.undo()
    assert len(run(engine, [[5, 6, 7]], greedy(4))[0]) == 4  # and the next step does not trip over it


def test_seed_is_a_signed_64_bit_integer_and_samples_near_the_bound_run(engine_checkpoints):
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(seed=18446744073709551615, n=2)
    assert refused.value.param == "seed"
    engine = make_engine(engine_checkpoints["qwen2"])
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=2**63 - 1, n=3, ignore_eos=True)
    engine.add_request(Request("edge", [5, 6, 7], params))
    choices: dict[int, list[int]] = {}
    while engine.has_work():
        for output in engine.step():
            assert output.error is None
            for d in output.deltas:
                choices.setdefault(d.index, []).extend(d.token_ids)
    assert sorted(choices) == [0, 1, 2] and all(len(t) == 6 for t in choices.values())


def test_n_and_stop_strings_are_capped(engine_checkpoints):
    path = engine_checkpoints["qwen2"]
    with pytest.raises(ConfigError, match="--max-n"):
        make_engine(path, max_num_seqs=4, max_n=5)
    engine = make_engine(path, max_num_seqs=4, max_stop_strings=2, max_stop_string_length=3)
    assert engine.config.max_n == 4
    cases = [
        (greedy(2, n=5), "n"),
        (greedy(2, stop=["a", "b", "c"]), "stop"),
        (greedy(2, stop=["abcd"]), "stop"),
    ]
    for params, param in cases:
        with pytest.raises(InvalidRequestError) as refused:
            engine.add_request(Request("big", [5, 6], params))
        assert refused.value.param == param
    engine.add_request(Request("ok", [5, 6], greedy(2, n=4, stop=["abc", "d"])))
    assert len(engine.scheduler.waiting) == 4


async def test_the_waiting_limit_counts_sequences_not_requests(engine_checkpoints):
    engine = AsyncLLMEngine(make_engine(engine_checkpoints["qwen2"], max_num_seqs=4, max_waiting_requests=4))
    first = engine.generate(Request("three", [5, 6], greedy(2, n=3)))
    pending = asyncio.ensure_future(anext(first))  # not started: its 3 sequences stay queued
    await asyncio.sleep(0)
    with pytest.raises(OverloadedError, match="waiting sequences"):
        await anext(engine.generate(Request("two", [5, 6], greedy(2, n=2))))
    pending.cancel()


async def test_a_failure_outside_a_batch_fails_requests_and_the_loop_serves_on(engine_checkpoints, monkeypatch):
    engine = AsyncLLMEngine(make_engine(engine_checkpoints["qwen2"]))
    engine.start()
    try:
        scheduler = engine.engine.scheduler
        real_schedule = scheduler.schedule

        def broken_once():
            monkeypatch.setattr(scheduler, "schedule", real_schedule)
            raise KeyError("injected bookkeeping fault")

        monkeypatch.setattr(scheduler, "schedule", broken_once)
        outputs = [o async for o in engine.generate(Request("doomed", [5, 6, 7], greedy(4)))]
        assert outputs[-1].finished and outputs[-1].error
        assert engine.healthy and engine.dead_reason is None
        outputs = [o async for o in engine.generate(Request("fine", [5, 6, 7], greedy(4)))]
        assert outputs[-1].error is None and sum(len(d.token_ids) for o in outputs for d in o.deltas) == 4
        assert engine.engine.block_manager.num_used_blocks == 0
    finally:
        await engine.shutdown()


async def test_a_dead_loop_reports_a_generic_reason_and_refuses_requests(engine_checkpoints, monkeypatch):
    engine = AsyncLLMEngine(make_engine(engine_checkpoints["qwen2"]))
    engine.start()
    try:
        monkeypatch.setattr(engine.engine, "stats", lambda: (_ for _ in ()).throw(KeyError("req-secret-id")))
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate(Request("req-secret-id", [5, 6, 7], greedy(4))):
                pass
        assert not engine.healthy
        assert engine.dead_reason and "req-secret-id" not in engine.dead_reason
        with pytest.raises(LoraplaneError) as refused:
            await anext(engine.generate(Request("later", [5, 6, 7], greedy(4))))
        assert refused.value.status_code == 503 and "req-secret-id" not in refused.value.message
    finally:
        await engine.shutdown()


def test_failing_everything_also_drops_sequences_of_no_known_request(engine_checkpoints):
    engine = make_engine(engine_checkpoints["qwen2"])
    engine.add_request(Request("known", [5, 6, 7], greedy(4)))
    engine.scheduler.add(Sequence(999, Request("orphan", [5, 6], greedy(4)), 0))  # as the old bug left
    outputs = engine.fail_all(RuntimeError("fault"))
    assert [o.request_id for o in outputs] == ["known"] and outputs[0].error
    assert not engine.has_work() and engine.block_manager.num_used_blocks == 0
