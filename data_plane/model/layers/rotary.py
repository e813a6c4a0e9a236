"""Rotary position embedding (neox style: rotate_half) with a precomputed cos/sin cache.

Inverse frequencies are computed in float32 exactly as transformers does, so cos/sin match its
rotary embedding bit for bit; the cache covers positions [0, max_position).
Supported rope types: default, linear, llama3. Dynamic NTK depends on the longest sequence of the
batch (the frequencies change with it), which a shared cache cannot express, so it is refused.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from shared.errors import UnsupportedModelError


def compute_inv_freq(head_dim: int, base: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, scaled per `rope_scaling`."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    assert rope_scaling is not None
    if rope_type == "linear":
        scaled: torch.Tensor = inv_freq / rope_scaling["factor"]
        return scaled
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise UnsupportedModelError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    # same expression order as transformers' _compute_llama3_parameters, for identical float results
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * scaled / factor + smooth_factor * scaled
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    cos_cache: torch.Tensor  # [max_position, head_dim / 2] float32, a buffer (register_buffer below)
    sin_cache: torch.Tensor

    def __init__(
        self, head_dim: int, max_position: int, base: float, rope_scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        inv_freq = compute_inv_freq(head_dim, base, rope_scaling)
        positions = torch.arange(max_position, dtype=torch.int64).to(torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2], the same float32 product transformers forms
        # non-persistent: derived from the config, never part of a checkpoint
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos [T, D/2], sin [T, D/2]) float32."""
        return self.cos_cache[positions], self.sin_cache[positions]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # q: [T, H, D], k: [T, Hkv, D]
        cos, sin = self.cos_sin(positions)
        return apply_rotary(q, cos.to(q.dtype), sin.to(q.dtype)), apply_rotary(k, cos.to(k.dtype), sin.to(k.dtype))

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, D/2] (already in x's dtype).

    Equals HF's x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), element for element.
    """
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    cos = cos.unsqueeze(1)  # [T, 1, D/2]: broadcast over heads
    sin = sin.unsqueeze(1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
