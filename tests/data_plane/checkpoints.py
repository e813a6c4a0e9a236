"""Tiny random Hugging Face checkpoints of each supported family, written with transformers (test-only).

Weights are re-drawn with a larger spread than transformers' init so that logits are far from uniform:
greedy decoding then produces varied tokens for many steps (a std-0.02 model collapses into one token)
and near-ties between the top two logits, which would make exact greedy comparisons flaky, are rare.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_COMMON: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)

FAMILIES: dict[str, dict[str, Any]] = {
    # Llama 3.1 style: llama3 rope scaling (original context 64 so all three frequency bands occur), untied
    "llama": dict(
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
    ),
    # Qwen2: q/k/v bias, tied embeddings
    "qwen2": dict(rope_theta=1000000.0, tie_word_embeddings=True),
    # Qwen3: per-head q/k norm, head_dim (32) != hidden / heads (16), untied
    "qwen3": dict(rope_theta=1000000.0, head_dim=32, tie_word_embeddings=False),
}


def _classes(family: str) -> tuple[type, type]:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    return {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }[family]


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int, std: float) -> None:
    """Seeded re-draw of every parameter: matrices N(0, std), norms 1 + N(0, 0.1), biases N(0, 0.1).

    Norm weights and biases are non-trivial on purpose so a mis-loaded norm or bias changes the logits.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if "norm" in name:
            param.copy_(1.0 + 0.1 * noise)
        elif name.endswith(".bias"):
            param.copy_(0.1 * noise)
        else:
            param.copy_(std * noise)


def write_tiny_checkpoint(
    path: Path, family: str, seed: int = 0, max_shard_size: str | int | None = None, std: float = 0.2,
    **config_overrides: Any,
) -> Path:
    """Write a 2-layer, hidden-64, vocab-512 float32 checkpoint of `family` ("llama", "qwen2", "qwen3").

    `max_shard_size` (e.g. "100KB") produces a sharded checkpoint with model.safetensors.index.json.
    """
    config_cls, model_cls = _classes(family)
    config = config_cls(**{**_COMMON, **FAMILIES[family], **config_overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    _randomize(model, seed, std)
    path.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    return path
