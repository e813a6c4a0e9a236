"""The engine's greedy tokens against transformers' generate, alone, batched, preempted, cached."""

from __future__ import annotations

import random

import pytest

from data_plane.engine.sampling_params import SamplingParams
from data_plane.engine.sequence import Request
from tests.data_plane.engine.conftest import greedy, hf_greedy, load_hf, make_engine, run

FAMILIES = ["llama", "qwen2", "qwen3"]


def _prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def _hf_greedy(path, prompts: list[list[int]], max_new_tokens: int, **generate_kwargs) -> list[list[int]]:
    return hf_greedy(load_hf(path), prompts, max_new_tokens, **generate_kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(engine_checkpoints, family):
    path = engine_checkpoints[family]
    engine = make_engine(path)
    prompts = _prompts(engine.vocab_size, [3, 9, 21, 40])
    expected = _hf_greedy(path, prompts, 32)
    assert all(len(set(t)) > 4 for t in expected), "the oracle collapsed; the checkpoint is too degenerate"
    got = [run(engine, [p], greedy(32))[0] for p in prompts]
    assert got == expected


def test_repetition_penalty_matches_transformers(engine_checkpoints):
    """The engine hands the sampler each sequence's prompt and output so far (engine/batch_builder.py)."""
    path = engine_checkpoints["llama"]
    engine = make_engine(path)
    prompts = _prompts(engine.vocab_size, [4, 11], seed=4)
    expected = _hf_greedy(path, prompts, 24, repetition_penalty=1.3)
    assert expected != _hf_greedy(path, prompts, 24), "the penalty changed nothing; the test could not fail"
    assert run(engine, prompts, greedy(24, repetition_penalty=1.3)) == expected


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batched_arrivals_match_one_at_a_time(engine_checkpoints, family):
    engine = make_engine(engine_checkpoints[family])
    prompts = _prompts(engine.vocab_size, [5, 30, 12, 1, 44, 17], seed=2)
    alone = [run(engine, [p], greedy(24))[0] for p in prompts]
    together = run(make_engine(engine_checkpoints[family]), prompts, greedy(24), arrive_every=3)
    assert together == alone


def test_preemption_under_tiny_kv_budget_keeps_tokens(engine_checkpoints):
    path = engine_checkpoints["qwen2"]
    prompts = _prompts(512, [10, 14, 9, 12], seed=3)
    alone = [run(make_engine(path), [p], greedy(32))[0] for p in prompts]
    tight = make_engine(path, num_kv_blocks=24)  # 96 token slots for 4 sequences of ~45 tokens
    together = run(tight, prompts, greedy(32))
    assert tight.scheduler.num_preemptions > 0
    assert together == alone
    assert tight.block_manager.num_used_blocks == 0


def test_fair_share_preemptions_keep_tokens_and_a_request_beside_a_full_batch_starts_at_the_next_step(
        engine_checkpoints):
    path = engine_checkpoints["qwen2"]
    prompts = _prompts(512, [6, 9, 7, 11, 8, 10, 5], seed=6)
    alone = [run(make_engine(path), [p], greedy(16))[0] for p in prompts]
    engine = make_engine(path, max_num_seqs=4)
    tokens: dict[str, list[int]] = {}
    first_token_steps: dict[str, int] = {}

    def step() -> None:
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(t for d in output.deltas for t in d.token_ids)
            if output.first_token_steps is not None:
                first_token_steps[output.request_id] = output.first_token_steps

    # one API request of six prompts fills the batch; a request of its own arrives three steps later
    engine.add_requests([Request(f"big{i}", p, greedy(16), group_id="big") for i, p in enumerate(prompts[:6])])
    for _ in range(3):
        step()
    engine.add_request(Request("small", prompts[6], greedy(16)))
    step()
    assert first_token_steps["small"] == 1 and engine.scheduler.num_preemptions == 1  # a seat of big's newest
    while engine.has_work():
        step()
    assert [tokens[f"big{i}"] for i in range(6)] + [tokens["small"]] == alone
    assert engine.block_manager.num_used_blocks == 0


def test_a_finished_sample_is_reported_once_while_its_siblings_still_run(engine_checkpoints):
    # 28 token slots for two samples of 23 (no prefix cache to resume from): the second waits for the first
    engine = make_engine(engine_checkpoints["qwen2"], num_kv_blocks=8, enable_prefix_caching=False)
    engine.add_request(Request("pair", [5, 6, 7], greedy(20, n=2)))
    finishes = []
    while engine.has_work():
        for output in engine.step():
            finishes += [d.index for d in output.deltas if d.finish_reason is not None]
    assert engine.scheduler.num_preemptions > 0  # so one sample ended steps before the other
    assert sorted(finishes) == [0, 1]


def test_prefix_cache_hit_keeps_output(engine_checkpoints):
    engine = make_engine(engine_checkpoints["llama"])
    prompt = _prompts(engine.vocab_size, [41], seed=4)[0]
    first = run(engine, [prompt], greedy(16))[0]
    hits_before = engine.block_manager.stats.hit_tokens
    second = run(engine, [prompt], greedy(16))[0]
    assert engine.block_manager.stats.hit_tokens - hits_before == 40  # ten full blocks; the last token is recomputed
    assert second == first
    # the same prompt through an engine without prefix caching agrees too
    plain = make_engine(engine_checkpoints["llama"], enable_prefix_caching=False)
    assert run(plain, [prompt], greedy(16))[0] == first
    assert plain.block_manager.stats.hit_tokens == 0


def test_prefix_cache_eviction_under_pressure_stays_correct(engine_checkpoints):
    path = engine_checkpoints["llama"]
    engine = make_engine(path, num_kv_blocks=20)
    prompts = _prompts(512, [30, 28, 33, 30, 29], seed=5)
    expected = [run(make_engine(path, enable_prefix_caching=False), [p], greedy(8))[0] for p in prompts]
    # 20 blocks hold about two of these sequences: the first round evicts as it goes; the second,
    # in reverse order, hits the most recent prefix and then runs into evicted ones
    order = list(range(len(prompts))) + list(reversed(range(len(prompts))))
    hits = []
    for i in order:
        before = engine.block_manager.stats.hit_tokens
        assert run(engine, [prompts[i]], greedy(8))[0] == expected[i]
        hits.append(engine.block_manager.stats.hit_tokens - before)
    assert hits[len(prompts)] > 0  # the last prompt again, straight after itself
    assert 0 in hits[len(prompts) + 2 :]  # an evicted one recomputed from scratch


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_choices(engine_checkpoints):
    engine = make_engine(engine_checkpoints["qwen2"])
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7, n=3, ignore_eos=True)
    outs = []
    for _ in range(2):
        engine.add_request(Request("s", [5, 6, 7, 8], params))
        per_choice: dict[int, list[int]] = {}
        while engine.has_work():
            for output in engine.step():
                for d in output.deltas:
                    per_choice.setdefault(d.index, []).extend(d.token_ids)
        outs.append(per_choice)
    assert outs[0] == outs[1]
    assert len({tuple(v) for v in outs[0].values()}) > 1


def test_stop_conditions(engine_checkpoints):
    engine = make_engine(engine_checkpoints["qwen2"])
    prompt = [3, 4, 5, 6]
    full = run(engine, [prompt], greedy(20))[0]
    stop_id = full[5]
    cut = run(engine, [prompt], greedy(20, stop_token_ids=[stop_id]))[0]
    assert cut == full[: full.index(stop_id) + 1]
    assert len(run(engine, [prompt], greedy(7))[0]) == 7


def test_too_long_prompt_is_rejected(engine_checkpoints):
    from shared.errors import InvalidRequestError

    engine = make_engine(engine_checkpoints["qwen2"], max_model_len=64)
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        engine.add_request(Request("x", [1] * 60, greedy(16)))
    assert not engine.has_work()


def test_a_failing_step_fails_its_requests_and_the_engine_serves_on(engine_checkpoints, monkeypatch):
    engine = make_engine(engine_checkpoints["qwen2"])
    expected = run(engine, [[5, 6, 7]], greedy(8))[0]
    real_forward = engine.runner.forward

    def broken_once(step):
        monkeypatch.setattr(engine.runner, "forward", real_forward)
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(engine.runner, "forward", broken_once)
    engine.add_request(Request("doomed", [5, 6, 7], greedy(8)))
    outputs = engine.step()
    assert [o.request_id for o in outputs] == ["doomed"] and outputs[0].finished
    assert "injected device fault" in outputs[0].error
    assert not engine.has_work() and engine.block_manager.num_used_blocks == 0
    assert run(engine, [[5, 6, 7]], greedy(8))[0] == expected
