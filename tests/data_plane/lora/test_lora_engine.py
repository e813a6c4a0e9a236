"""Multi-LoRA in the engine against transformers + PEFT: alone, mixed, more adapters than slots."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from data_plane.adapters.loading.peft_loader import load_peft_adapter
from data_plane.engine.llm_engine import LLMEngine
from data_plane.engine.sampling_params import SamplingParams
from data_plane.engine.sequence import Request
from data_plane.lora.kernels.cpu import CPUKernels
from data_plane.lora.kernels.select import KERNELS_ENV
from data_plane.lora.ops import TORCH_KERNELS
from data_plane.lora.weights import LoRAAdapterWeights
from data_plane.model.config import ModelConfig
from tests.data_plane.engine.conftest import make_engine

KINDS = ["patterns", "rslora", "attention"]
NEW_TOKENS = 24


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(rng.randrange(4, 30))] for _ in range(n)]


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)


def _hf_generate(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _load(base: Path, adapter: Path) -> LoRAAdapterWeights:
    return load_peft_adapter(adapter, ModelConfig.from_pretrained(base), max_rank=64, allowed_roots=[str(adapter.parent)])


def _run(engine: LLMEngine, jobs: list[tuple[list[int], int, LoRAAdapterWeights | None]], arrive_every: int = 0):
    """jobs: (prompt, adapter_id, weights); returns tokens and logprob dicts per job."""
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[dict[int, float]]] = {}
    pending = list(enumerate(jobs))
    steps = 0
    while pending or engine.has_work():
        while pending and steps >= pending[0][0] * arrive_every:
            i, (prompt, adapter_id, weights) = pending.pop(0)
            seed = weights.cache_namespace if weights else 0
            engine.add_request(Request(f"j{i}", prompt, _greedy(), adapter_id=adapter_id, prefix_hash_seed=seed, lora=weights))
            tokens[f"j{i}"], logprobs[f"j{i}"] = [], []
        for output in engine.step():
            for delta in output.deltas:
                tokens[output.request_id].extend(delta.token_ids)
                logprobs[output.request_id].extend(delta.logprobs or [])
        steps += 1
        assert steps < 5000
    keys = [f"j{i}" for i in range(len(jobs))]
    return [tokens[k] for k in keys], [logprobs[k] for k in keys]


@pytest.fixture(scope="module")
def setup(engine_checkpoints, peft_adapters):
    base = engine_checkpoints["llama"]
    adapters = {kind: peft_adapters("llama", kind) for kind in KINDS}
    weights = {kind: _load(base, path) for kind, path in adapters.items()}
    prompts = _prompts(2, seed=11)
    expected: dict[str, list[list[int]]] = {}
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    expected["base"] = [_hf_generate(hf, p) for p in prompts]
    for kind, path in adapters.items():
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval(), path
        ).eval()
        peft_model.generation_config.eos_token_id = None
        expected[kind] = [_hf_generate(peft_model, p) for p in prompts]
        assert expected[kind] != expected["base"], f"adapter {kind} does not change the output; the test is blind"
    return base, weights, prompts, expected


@pytest.fixture(params=["auto", "torch"])
def lora_kernels(request, monkeypatch) -> str:
    """Both backends of the mixed-adapter ops: the compiled CPU kernels (auto) and the pure-torch ops."""
    monkeypatch.setenv(KERNELS_ENV, request.param)
    return request.param


def test_each_adapter_matches_peft(setup, lora_kernels):
    base, weights, prompts, expected = setup
    engine = make_engine(base, enable_lora=True, max_loras=3, max_lora_rank=64)
    for adapter_id, kind in enumerate(KINDS, start=1):
        got, _ = _run(engine, [(p, adapter_id, weights[kind]) for p in prompts])
        assert got == expected[kind], kind


def test_mixed_batch_with_more_adapters_than_slots_matches(setup, lora_kernels):
    base, weights, prompts, expected = setup
    engine = make_engine(base, enable_lora=True, max_loras=2, max_lora_rank=64)
    kernels = engine.lora_slots.layers[0][0].kernels
    assert isinstance(kernels, CPUKernels) if lora_kernels == "auto" else kernels is TORCH_KERNELS
    jobs, want = [], []
    for prompt_index, prompt in enumerate(prompts):
        jobs.append((prompt, 0, None))
        want.append(expected["base"][prompt_index])
        for adapter_id, kind in enumerate(KINDS, start=1):
            jobs.append((prompt, adapter_id, weights[kind]))
            want.append(expected[kind][prompt_index])
    got, _ = _run(engine, jobs, arrive_every=2)
    assert got == want
    stats = engine.stats().lora
    assert stats.slots_total == 2 and sum(a.evictions for a in stats.adapters.values()) > 0
    # steps counted by distinct adapters (from StepInput.adapter_ids): two slots hold at most two
    assert max(engine.stats().step_adapters) == 2


def test_base_requests_are_bit_identical_with_lora_enabled(setup):
    base, weights, prompts, expected = setup
    plain_tokens, plain_logprobs = _run(make_engine(base), [(p, 0, None) for p in prompts])
    lora_engine = make_engine(base, enable_lora=True, max_loras=2, max_lora_rank=64)
    # the same traffic gives the same floats, bit for bit: base tokens never touch LoRA weights
    tokens, logprobs = _run(lora_engine, [(p, 0, None) for p in prompts])
    assert tokens == plain_tokens == expected["base"]
    assert logprobs == plain_logprobs
    # sharing the batch with adapter requests changes the batch shape (so the last float bits of the
    # base matmuls may move, as in any engine) but not the tokens
    jobs = [(p, 0, None) for p in prompts] + [(p, 1, weights["patterns"]) for p in prompts]
    tokens, _ = _run(lora_engine, jobs)
    assert tokens[: len(prompts)] == expected["base"]


def test_prefix_cache_is_isolated_per_adapter_content(setup):
    base, weights, _, expected = setup
    engine = make_engine(base, enable_lora=True, max_loras=2, max_lora_rank=64)
    prompt = _prompts(1, seed=12)[0] * 3  # long enough for several full blocks
    hits = lambda: engine.block_manager.stats.hit_tokens  # noqa: E731
    first, _ = _run(engine, [(prompt, 1, weights["patterns"])])
    before = hits()
    _run(engine, [(prompt, 2, weights["rslora"])])
    assert hits() == before  # another adapter never reuses these blocks
    _run(engine, [(prompt, 0, None)])
    assert hits() == before  # nor does the base model
    again, _ = _run(engine, [(prompt, 1, weights["patterns"])])
    assert hits() > before and again == first


def test_adapter_request_fails_clearly_when_every_slot_is_pinned(setup):
    from shared.errors import OverloadedError

    base, weights, prompts, _ = setup
    engine = make_engine(base, enable_lora=True, max_loras=1, max_lora_rank=64)
    engine.pin_lora(1, weights["patterns"])
    engine.add_request(Request("blocked", prompts[0], _greedy(), adapter_id=2, lora=weights["rslora"],
                               prefix_hash_seed=weights["rslora"].cache_namespace))
    outputs = engine.step()
    assert len(outputs) == 1 and outputs[0].finished
    assert isinstance(outputs[0].client_error, OverloadedError) and "pinned" in outputs[0].client_error.message
    assert not engine.has_work() and engine.block_manager.num_used_blocks == 0
    got, _ = _run(engine, [(prompts[0], 1, weights["patterns"])])  # the pinned adapter still serves
    assert got == [setup[3]["patterns"][0]]


def test_an_arriving_request_has_its_slot_image_made_before_any_step(setup):
    """add_request prepares the adapter's slot image, so the step that admits it copies that very image
    (no build inside the step), and the tokens are still PEFT's."""
    base, weights, prompts, expected = setup
    engine = make_engine(base, enable_lora=True, max_loras=2, max_lora_rank=64)
    request = Request("early", prompts[0], _greedy(), adapter_id=1,
                      prefix_hash_seed=weights["patterns"].cache_namespace, lora=weights["patterns"])
    pool = engine.lora_slots.pool
    assert not pool.is_prepared(weights["patterns"])
    engine.add_request(request)
    assert pool.is_prepared(weights["patterns"])
    image = pool.prepare(weights["patterns"])  # the kept one, made by add_request
    tokens: list[int] = []
    while engine.has_work():
        for output in engine.step():
            tokens.extend(t for d in output.deltas for t in d.token_ids)
    assert tokens == expected["patterns"][0]
    slot = engine.lora_slots.slot(1)
    assert torch.equal(pool.pool[slot], image)


def _tokens_of(outputs, tokens: dict[str, list[int]]) -> None:  # noqa: ANN001
    for output in outputs:
        for delta in output.deltas:
            tokens.setdefault(output.request_id, []).extend(delta.token_ids)


def _running_then_arriving(engine: LLMEngine, weights: dict, prompts: list[list[int]]) -> dict[str, list[int]]:
    """`running` (adapter 1) added to the idle engine and stepped once, then `arriving` (adapter 2, not in
    a slot) added while it runs; answers the tokens so far, by request."""
    tokens: dict[str, list[int]] = {}
    for name, adapter_id, kind, prompt in (("running", 1, "patterns", prompts[0]), ("arriving", 2, "rslora", prompts[1])):
        engine.add_request(Request(name, prompt, _greedy(), adapter_id=adapter_id, lora=weights[kind],
                                   prefix_hash_seed=weights[kind].cache_namespace))
        if name == "running":
            assert engine.lora_slots.pool.is_prepared(weights[kind])  # nothing ran: made at once
            _tokens_of(engine.step(), tokens)
    return tokens


def test_a_request_arriving_while_others_run_waits_for_its_image_made_beside_the_steps(setup, monkeypatch) -> None:
    """While sequences run, the arriving adapter's slot image is made on the image thread (not between
    two steps): the running stream keeps stepping, the new adapter is loaded only once its image is kept,
    and both answers are PEFT's."""
    base, weights, prompts, expected = setup
    engine = make_engine(base, enable_lora=True, max_loras=2, max_lora_rank=64)
    pool, slots = engine.lora_slots.pool, engine.lora_slots
    release = threading.Event()
    paced = pool._prepare_paced
    monkeypatch.setattr(pool, "_prepare_paced", lambda w: (release.wait(30), paced(w)))
    tokens = _running_then_arriving(engine, weights, prompts)
    assert slots.image_pending(weights["rslora"]) and not pool.is_prepared(weights["rslora"])
    for _ in range(3):  # the running stream goes on; the arriving one waits for its image
        _tokens_of(engine.step(), tokens)
        assert not slots.is_resident(2) and "arriving" not in tokens
    assert len(tokens["running"]) == 4
    release.set()
    deadline = time.monotonic() + 30
    while slots.image_pending(weights["rslora"]):
        assert time.monotonic() < deadline, "the image thread did not finish the image"
        time.sleep(0.01)
    image = pool.prepare(weights["rslora"])  # the kept one, made on the image thread
    _tokens_of(engine.step(), tokens)
    assert slots.is_resident(2) and torch.equal(pool.pool[slots.slot(2)], image)
    while engine.has_work():
        _tokens_of(engine.step(), tokens)
    assert tokens["running"] == expected["patterns"][0] and tokens["arriving"] == expected["rslora"][1]


def test_a_head_that_waited_its_bounded_steps_is_loaded_with_its_image_still_pending(setup, monkeypatch) -> None:
    """The image thread never finishing cannot hold a request back for ever: the head's bounded wait loads
    its adapter anyway, making the image in the step."""
    base, weights, prompts, expected = setup
    engine = make_engine(base, enable_lora=True, max_loras=2, max_lora_rank=64)
    engine.scheduler.max_slot_wait_steps = 2
    release = threading.Event()
    monkeypatch.setattr(engine.lora_slots.pool, "_prepare_paced", lambda w: release.wait(30))
    try:
        tokens = _running_then_arriving(engine, weights, prompts)
        for _ in range(4):
            _tokens_of(engine.step(), tokens)
        assert engine.lora_slots.is_resident(2) and engine.lora_slots.image_pending(weights["rslora"])
        while engine.has_work():
            _tokens_of(engine.step(), tokens)
    finally:
        release.set()
    assert tokens["running"] == expected["patterns"][0] and tokens["arriving"] == expected["rslora"][1]


def _peft_with_rounded_weights(base: Path, adapter: Path, dtype: torch.dtype):
    """PEFT with each A and each scaled B rounded to `dtype` (as the engine's slots hold them), in float32:
    the oracle for --lora-dtype, which stores exactly those roundings."""
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval(), adapter).eval()
    rounded = 0
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                scale = module.scaling["default"]
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                a.copy_(a.to(dtype).float())
                b.copy_((b * scale).to(dtype).float() / scale)
                rounded += 1
    assert rounded > 0
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("lora_dtype", ["bfloat16", "float16"])
def test_half_width_slots_match_peft_on_the_rounded_weights(setup, peft_adapters, lora_kernels, lora_dtype):
    """--lora-dtype bfloat16|float16 under a float32 model: slots hold the weights rounded once, sums stay
    float32, so every token is PEFT's with those roundings; the default (auto) keeps the model's dtype."""
    base, weights, prompts, _ = setup
    dtype = getattr(torch, lora_dtype)
    engine = make_engine(base, enable_lora=True, max_loras=2, max_lora_rank=64, lora_dtype=lora_dtype)
    assert engine.lora_slots.pool.pool.dtype == dtype
    assert make_engine(base, enable_lora=True, max_loras=1, max_lora_rank=64).lora_slots.pool.pool.dtype == torch.float32
    kinds = ["patterns", "rslora"]
    want = []
    for kind in kinds:
        oracle = _peft_with_rounded_weights(base, peft_adapters("llama", kind), dtype)
        want.extend(_hf_generate(oracle, p) for p in prompts)
    jobs = [(p, adapter_id, weights[kind]) for adapter_id, kind in enumerate(kinds, start=1) for p in prompts]
    got, _ = _run(engine, jobs)  # both adapters in one batch: the mixed-adapter kernels
    assert got == want
