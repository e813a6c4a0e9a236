"""oneDNN-packed weights: a [out, in] weight reordered once into oneDNN's blocked layout, multiplied without
reordering it again on every call (torch's mkldnn linear ops)."""

from __future__ import annotations

import torch

PACK_BATCH_HINT = 32  # the batch oneDNN picks the packed layout for; any batch multiplies correctly


def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies `dtype` packed on this CPU: bfloat16 with AVX-512 BF16 or AMX (not on an
    AVX2-only CPU, nor under ONEDNN_MAX_CPU_ISA=AVX2)."""
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor) -> torch.Tensor:  # [out, in] -> the same, oneDNN's opaque layout
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
    return packed


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x Wᵀ (+ bias): x [T, in] -> [T, out], with W packed by `pack`."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out
