"""Chunked prefill: prompts far longer than the step's token budget, computed a chunk per step beside
running decodes, give transformers' (and PEFT's) greedy tokens and logprobs; every step stays within
the budget; the prefix cache, preemption and adapters keep working; the flags reach the config."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from data_plane.adapters.loading.peft_loader import load_peft_adapter
from data_plane.api.server import build_parser, config_from_args
from data_plane.config import ConfigError, EngineConfig
from data_plane.engine.block_manager import BlockManager
from data_plane.engine.llm_engine import LLMEngine
from data_plane.engine.prefill_pacer import LONG_PREFILL_TOKENS, MIN_LONG_CHUNK, PrefillPacer
from data_plane.engine.sampling_params import SamplingParams
from data_plane.engine.scheduler import Scheduler
from data_plane.engine.sequence import Request, Sequence
from data_plane.model.config import ModelConfig
from tests.data_plane.engine.conftest import greedy, hf_greedy, load_hf, make_engine, run
from tests.data_plane.peft_adapters import write_peft_adapter

BUDGET = 16  # tokens per step: a 100-token prompt takes seven steps or more


@dataclass
class StepRecord:
    num_decodes: int
    chunks: list[tuple[int, int]]  # per prefill: (tokens computed this step, tokens it still had to compute)

    @property
    def num_tokens(self) -> int:
        return self.num_decodes + sum(new for new, _ in self.chunks)


def record_steps(engine: LLMEngine) -> list[StepRecord]:
    """What the scheduler hands the engine each step (the real scheduler; this only looks on)."""
    records: list[StepRecord] = []
    schedule = engine.scheduler.schedule

    def recorded():
        out = schedule()
        chunks = [(p.num_new_tokens, len(p.seq) - p.seq.num_computed_tokens) for p in out.prefills]
        records.append(StepRecord(len(out.decodes), chunks))
        return out

    engine.scheduler.schedule = recorded
    return records


def assert_chunked_beside_decodes(records: list[StepRecord]) -> None:
    assert all(r.num_tokens <= BUDGET for r in records)
    # a prompt was cut short of its end in a step that also decoded: the chunk ran beside the decodes
    assert any(r.num_decodes and any(new < left for new, left in r.chunks) for r in records)


def _prompts(lengths: list[int], seed: int, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_chunked_prompts_beside_decodes_give_transformers_tokens(engine_checkpoints, family):
    path = engine_checkpoints[family]
    prompts = _prompts([100, 37, 100, 5, 64], seed=21)
    expected = hf_greedy(load_hf(path), prompts, 12)
    engine = make_engine(path, max_num_batched_tokens=BUDGET, max_num_seqs=8)
    records = record_steps(engine)
    assert run(engine, prompts, greedy(12), arrive_every=3) == expected
    assert_chunked_beside_decodes(records)
    assert engine.block_manager.num_used_blocks == 0


def test_chunked_logprobs_equal_transformers_logits(engine_checkpoints):
    path = engine_checkpoints["qwen2"]
    hf = load_hf(path)
    prompts = _prompts([100, 9], seed=22)
    engine = make_engine(path, max_num_batched_tokens=BUDGET, max_num_seqs=8)
    records = record_steps(engine)
    engine.add_request(Request("short", prompts[1], greedy(40)))  # decodes while the long one is chunked
    engine.step()
    engine.add_request(Request("long", prompts[0], greedy(10, logprobs=5)))
    tokens: list[int] = []
    logprobs: list[dict[int, float]] = []
    while engine.has_work():
        for output in engine.step():
            if output.request_id == "long":
                for delta in output.deltas:
                    tokens.extend(delta.token_ids)
                    logprobs.extend(delta.logprobs or [])
    assert_chunked_beside_decodes(records)
    with torch.no_grad():
        logits = hf(torch.tensor([prompts[0] + tokens])).logits[0].float()  # [L, V]
    want = torch.log_softmax(logits[len(prompts[0]) - 1 : -1], dim=-1)  # the rows that chose each token
    assert tokens == want.argmax(dim=-1).tolist()
    for row, got in zip(want, logprobs, strict=True):
        assert len(got) >= 5
        for token_id, lp in got.items():
            assert abs(lp - float(row[token_id])) < 1e-4


def test_chunked_prefill_of_an_adapter_beside_base_decodes_gives_peft_tokens(engine_checkpoints, tmp_path):
    base = engine_checkpoints["llama"]
    adapter = write_peft_adapter(base, tmp_path / "adapter", "patterns")
    weights = load_peft_adapter(adapter, ModelConfig.from_pretrained(base), max_rank=64,
                                allowed_roots=[str(tmp_path)])
    prompts = _prompts([100, 30, 90, 60], seed=23)
    uses_adapter = [True, False, True, False]
    peft = PeftModel.from_pretrained(load_hf(base), adapter).eval()
    peft.generation_config.eos_token_id = None
    expected = [hf_greedy(peft if lora else load_hf(base), [p], 10)[0] for p, lora in zip(prompts, uses_adapter, strict=True)]
    assert expected[0] != hf_greedy(load_hf(base), [prompts[0]], 10)[0], "the adapter changes nothing"

    engine = make_engine(base, max_num_batched_tokens=BUDGET, max_num_seqs=8, enable_lora=True, max_loras=2)
    records = record_steps(engine)
    got: dict[str, list[int]] = {f"j{i}": [] for i in range(len(prompts))}
    pending = list(enumerate(zip(prompts, uses_adapter, strict=True)))
    steps = 0
    while pending or engine.has_work():
        if pending and steps % 3 == 0:
            i, (prompt, lora) = pending.pop(0)
            engine.add_request(Request(f"j{i}", prompt, greedy(10), adapter_id=1 if lora else 0,
                                       prefix_hash_seed=weights.cache_namespace if lora else 0,
                                       lora=weights if lora else None))
        for output in engine.step():
            for delta in output.deltas:
                got[output.request_id].extend(delta.token_ids)
        steps += 1
        assert steps < 1000
    assert [got[f"j{i}"] for i in range(len(prompts))] == expected
    assert_chunked_beside_decodes(records)


def test_a_prefix_computed_by_a_running_chunked_prefill_serves_a_later_arrival(engine_checkpoints):
    path = engine_checkpoints["llama"]
    prompt = _prompts([100], seed=24)[0]
    expected = run(make_engine(path, enable_chunked_prefill=False), [prompt], greedy(8))[0]
    engine = make_engine(path, max_num_batched_tokens=BUDGET, max_num_seqs=8)
    # the second copy arrives after two chunks (32 tokens, eight blocks of 4) of the first are in the cache
    assert run(engine, [prompt, prompt], greedy(8), arrive_every=2) == [expected, expected]
    assert 32 <= engine.block_manager.stats.hit_tokens < 100


def test_preemption_with_chunked_prefill_keeps_tokens(engine_checkpoints):
    path = engine_checkpoints["qwen2"]
    prompts = _prompts([40, 52, 36, 44], seed=25)
    alone = [run(make_engine(path, enable_chunked_prefill=False), [p], greedy(32))[0] for p in prompts]
    tight = make_engine(path, num_kv_blocks=48, max_num_batched_tokens=BUDGET, max_num_seqs=8)
    records = record_steps(tight)
    assert run(tight, prompts, greedy(32)) == alone
    assert tight.scheduler.num_preemptions > 0
    assert all(r.num_tokens <= BUDGET for r in records)
    assert tight.block_manager.num_used_blocks == 0


def _seq(seq_id: int, prompt_len: int) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return Sequence(seq_id, Request(f"s{seq_id}", list(range(1, prompt_len + 1)), params), 0)


def test_the_scheduler_spends_the_budget_on_decodes_first_then_chunks():
    scheduler = Scheduler(BlockManager(64, block_size=4), max_num_seqs=8, max_num_batched_tokens=BUDGET,
                          enable_chunked_prefill=True)
    decoding = [_seq(i, 3) for i in range(3)]
    for seq in decoding:
        scheduler.add(seq)
    scheduler.schedule()  # their prompts
    for seq in decoding:
        seq.num_computed_tokens = len(seq)
        seq.output_token_ids.append(9)
    long = _seq(3, 50)
    scheduler.add(long)
    chunks = []
    while not chunks or long.num_computed_tokens < len(long):
        out = scheduler.schedule()
        assert out.decodes == decoding  # every step, before any chunk
        (prefill,) = out.prefills
        chunks.append(prefill.num_new_tokens)
        long.num_computed_tokens += prefill.num_new_tokens
        for seq in decoding:
            seq.num_computed_tokens = len(seq)
            seq.output_token_ids.append(9)
    assert chunks == [13, 13, 13, 11]  # what the three decodes leave of 16
    assert long.block_table and len(long.block_table) == 13  # blocks for the whole prompt from the start
    # without chunking, the 50 tokens never fit what the decodes leave of the budget
    whole = Scheduler(BlockManager(64, block_size=4), max_num_seqs=8, max_num_batched_tokens=BUDGET)
    whole.add(_seq(4, 50))
    assert whole.schedule().is_empty


def test_chunked_prefill_flags(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")

    def config(*flags: str) -> EngineConfig:
        return config_from_args(build_parser().parse_args(["--model", str(tmp_path), *flags]))

    on = config("--max-num-batched-tokens", "256", "--max-num-seqs", "64")
    on.finalize(model_max_len=4096)  # a budget below --max-model-len is fine with chunking
    assert on.enable_chunked_prefill and on.max_num_batched_tokens == 256
    default = config()
    default.finalize(model_max_len=8192)
    assert default.max_num_batched_tokens == 2048  # vLLM's default with chunked prefill on CPU
    off = config("--no-enable-chunked-prefill")
    off.finalize(model_max_len=8192)
    assert not off.enable_chunked_prefill and off.max_num_batched_tokens == 8192
    with pytest.raises(ConfigError, match="without chunked prefill"):
        config("--no-enable-chunked-prefill", "--max-num-batched-tokens", "256").finalize(model_max_len=4096)
    with pytest.raises(ConfigError, match="--max-num-seqs"):
        config("--max-num-batched-tokens", "64").finalize(model_max_len=4096)  # 128 decodes cannot fit 64
    assert default.decode_stall_limit == 1.25 and config("--decode-stall-limit", "0").decode_stall_limit == 0
    with pytest.raises(ConfigError, match="--decode-stall-limit"):
        config("--decode-stall-limit", "0.5")
    assert default.long_prefill_token_threshold == LONG_PREFILL_TOKENS
    assert config("--long-prefill-token-threshold", "0").long_prefill_token_threshold == 0
    with pytest.raises(ConfigError, match="--long-prefill-token-threshold"):
        config("--long-prefill-token-threshold", "-1")


def _decoding(scheduler: Scheduler, count: int) -> list[Sequence]:
    """`count` sequences past their prompts, decoding."""
    seqs = [_seq(i, 3) for i in range(count)]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.schedule()
    for seq in seqs:
        seq.num_computed_tokens = len(seq)
        seq.output_token_ids.append(9)
    return seqs


def test_long_prompts_beside_decodes_get_the_pacers_share_and_short_ones_run_whole():
    pacer = PrefillPacer(1.25)
    for _ in range(4):
        pacer.observe(3, 0, 0.010)
    scheduler = Scheduler(BlockManager(512, block_size=4), max_num_seqs=8, max_num_batched_tokens=1024,
                          enable_chunked_prefill=True, prefill_pacer=pacer)
    _decoding(scheduler, 3)
    long, short = _seq(10, LONG_PREFILL_TOKENS + 100), _seq(11, LONG_PREFILL_TOKENS)
    scheduler.add(long)
    scheduler.add(short)
    out = scheduler.schedule()
    share = pacer.long_prefill_budget(3)
    assert share < 1024 - 3  # what the token budget alone would have given the long prompt
    assert [(p.seq, p.num_new_tokens) for p in out.prefills] == [(long, share), (short, len(short))]
    # with no decodes running, nothing is stalled: the long prompt takes what the budget leaves
    idle = Scheduler(BlockManager(512, block_size=4), max_num_seqs=8, max_num_batched_tokens=128,
                     enable_chunked_prefill=True, prefill_pacer=pacer)
    idle.add(_seq(12, LONG_PREFILL_TOKENS + 100))
    assert [p.num_new_tokens for p in idle.schedule().prefills] == [128]


def test_more_long_prompts_per_decode_get_a_larger_share():
    """Three long prompts beside four decodes may take a step of 1 + 3/4 times the decodes' alone: three
    times the room one prompt gets (1 + 1/4, the stall limit). (The pacer is warmed first, so that its growth
    bound of twice the last share does not bind.)"""
    def first_shares(long_prompts: int) -> list[int]:
        pacer = PrefillPacer(1.25)
        for _ in range(4):
            pacer.observe(4, 0, 0.010)
        for _ in range(8):  # a prefill token costs 0.1 ms beside the decodes
            share = pacer.long_prefill_budget(4, 3)
            pacer.observe(4, share, 0.010 + share * 0.0001)
            pacer.observe(4, 0, 0.010)
        scheduler = Scheduler(BlockManager(1024, block_size=4), max_num_seqs=8, max_num_batched_tokens=1024,
                              enable_chunked_prefill=True, prefill_pacer=pacer)
        _decoding(scheduler, 4)
        for i in range(long_prompts):
            scheduler.add(_seq(10 + i, LONG_PREFILL_TOKENS + 400))
        return [p.num_new_tokens for p in scheduler.schedule().prefills]

    assert first_shares(1) == [25]  # 0.25 * 10 ms / 0.1 ms
    assert first_shares(3) == [75]  # 0.75 * 10 ms / 0.1 ms, to the oldest prompt


def test_threshold_zero_paces_every_prompt_beside_decodes():
    """--long-prefill-token-threshold 0: a short prompt beside running decodes gets the pacer's share too
    (a few tokens a step, growing), instead of running whole in one long step; with the default it runs
    whole. Without decodes it still runs whole."""
    def scheduler(threshold: int, pacer: PrefillPacer) -> Scheduler:
        return Scheduler(BlockManager(512, block_size=4), max_num_seqs=8, max_num_batched_tokens=1024,
                         enable_chunked_prefill=True, prefill_pacer=pacer, long_prefill_tokens=threshold)

    def measured() -> PrefillPacer:
        pacer = PrefillPacer(1.25)
        for _ in range(4):
            pacer.observe(3, 0, 0.010)
        return pacer

    for threshold, whole in ((0, False), (LONG_PREFILL_TOKENS, True)):
        pacer = measured()
        paced = scheduler(threshold, pacer)
        _decoding(paced, 3)
        short = _seq(10, 30)
        paced.add(short)
        (prefill,) = paced.schedule().prefills
        if whole:
            assert prefill.num_new_tokens == 30
        else:
            assert prefill.num_new_tokens == pacer.long_prefill_budget(3) < 30
    idle = scheduler(0, measured())
    idle.add(_seq(12, 30))
    assert [p.num_new_tokens for p in idle.schedule().prefills] == [30]


@pytest.mark.parametrize("threshold", [LONG_PREFILL_TOKENS, 0])
def test_a_paced_long_prompt_beside_decodes_gives_transformers_tokens(engine_checkpoints, threshold):
    """The defaults (budget 2048, stall limit 1.25), and threshold 0, which paces the short prompts too."""
    path = engine_checkpoints["qwen2"]
    prompts = _prompts([20, 24, LONG_PREFILL_TOKENS + 60, 16], seed=26)
    expected = hf_greedy(load_hf(path), prompts, 16)
    engine = make_engine(path, max_num_seqs=8, long_prefill_token_threshold=threshold)
    records = record_steps(engine)
    assert run(engine, prompts, greedy(16), arrive_every=3) == expected
    if threshold == 0:  # the short prompts that arrived beside decodes were cut too
        assert any(left > new for r in records if r.num_decodes for new, left in r.chunks if left < LONG_PREFILL_TOKENS)
    beside = [new for r in records if r.num_decodes for new, left in r.chunks if left > LONG_PREFILL_TOKENS]
    # the long prompt was cut into chunks beside the decodes; at the default threshold the pacer has measured
    # only decode steps when it arrives, so its first chunk is at most twice the smallest (at 0 the short
    # prompts' chunks were measured first, and the budget they earned may be larger)
    assert beside and beside[0] < LONG_PREFILL_TOKENS + 60
    if threshold == LONG_PREFILL_TOKENS:
        assert beside[0] <= 2 * MIN_LONG_CHUNK
    assert engine.block_manager.num_used_blocks == 0
