"""Helpers to drive a real LLMEngine step by step on the tiny checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch

from data_plane.config import EngineConfig
from data_plane.engine.llm_engine import LLMEngine
from data_plane.engine.sampling_params import SamplingParams
from data_plane.engine.sequence import Request


def make_engine(path: Path, **overrides) -> LLMEngine:
    config = EngineConfig(model=str(path), device="cpu", block_size=overrides.pop("block_size", 4), **overrides)
    return LLMEngine.from_config(config)


def greedy(max_tokens: int = 32, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, arrive_every: int = 0) -> list[list[int]]:
    """Run prompts to completion; with arrive_every > 0, request i arrives after i*arrive_every steps."""
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_work():
        while pending and steps >= pending[0][0] * arrive_every:
            i, prompt = pending.pop(0)
            engine.add_request(Request(f"r{i}", list(prompt), params))
        for output in engine.step():
            for delta in output.deltas:
                tokens[output.request_id].extend(delta.token_ids)
        steps += 1
        assert steps < 10_000, "engine made no progress"
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def load_hf(path: Path):
    """transformers' model of the checkpoint (the oracle), set to run as the engine does with ignore_eos."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, **generate_kwargs) -> list[list[int]]:
    """Greedy tokens of a transformers (or PEFT) model, one prompt at a time."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0, **generate_kwargs)
        out.append(gen[0, len(prompt):].tolist())
    return out
