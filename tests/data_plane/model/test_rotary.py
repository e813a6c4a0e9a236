"""Rotary cos/sin and rotation against transformers' LlamaRotaryEmbedding / apply_rotary_pos_emb."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from data_plane.model.config import ModelConfig
from data_plane.model.layers.rotary import RotaryEmbedding, compute_inv_freq
from shared.errors import UnsupportedModelError

MAX_POS = 4096
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    # Llama 3.1's real values, and a small original context so every band (kept, scaled, smoothed) occurs
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "llama3_short": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def _hf_config(scaling: dict | None, head_dim: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=32, hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=32, num_hidden_layers=1, max_position_embeddings=MAX_POS,
        rope_theta=500000.0, rope_scaling=scaling,
    )


@pytest.mark.parametrize("head_dim", [16, 128])
@pytest.mark.parametrize("name", list(SCALINGS))
def test_cos_sin_equal_transformers(name, head_dim):
    hf_config = _hf_config(SCALINGS[name], head_dim)
    # go through our config parser, so the rope_parameters spelling transformers writes is covered too
    config = ModelConfig.from_dict({**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    ours = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
    hf = LlamaRotaryEmbedding(hf_config)
    positions = torch.cat([torch.arange(0, 200), torch.tensor([1000, 2047, 4095])])
    hf_cos, hf_sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])  # [1, T, D]
    cos, sin = ours.cos_sin(positions)  # [T, D/2]
    torch.testing.assert_close(torch.cat([cos, cos], -1), hf_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat([sin, sin], -1), hf_sin[0], atol=1e-6, rtol=0)


def test_llama3_scaling_changes_low_frequencies_only():
    plain = compute_inv_freq(128, 500000.0, None)
    scaled = compute_inv_freq(128, 500000.0, SCALINGS["llama3"])
    assert torch.equal(scaled[:4], plain[:4])  # high frequencies kept
    torch.testing.assert_close(scaled[-4:], plain[-4:] / 8.0)  # low frequencies divided by factor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_equals_apply_rotary_pos_emb(dtype):
    hf_config = _hf_config(SCALINGS["llama3_short"], 16)
    rope = RotaryEmbedding(16, MAX_POS, 500000.0, SCALINGS["llama3_short"])
    positions = torch.tensor([0, 1, 5, 63, 64, 300])
    q = torch.randn(6, 4, 16, dtype=dtype)  # [T, H, D]
    k = torch.randn(6, 2, 16, dtype=dtype)
    ours_q, ours_k = rope(positions, q, k)
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_config)(q, positions[None])  # cast to q's dtype like ours
    # HF rotates [B, H, T, D]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    torch.testing.assert_close(ours_q, hf_q[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(ours_k, hf_k[0].transpose(0, 1), atol=0, rtol=0)


def test_dynamic_rope_is_refused():
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        compute_inv_freq(16, 10000.0, {"rope_type": "dynamic", "factor": 2.0})
