"""A linear weight laid out once for the CPU's matmul, multiplied through `linear(x, bias)`.

- `PackedWeight`: oneDNN's blocked layout ([out, in] reordered once; torch's mkldnn linear ops), so that
  no call reorders it again. For bfloat16 where oneDNN multiplies it natively (AVX-512 BF16, AMX).
- `WidenedWeight`: a float32 copy, column-major, for bfloat16/float16 on a CPU without native
  half-precision dot products (AVX2 only), where torch's half-precision matmul runs several times slower
  than float32 BLAS. x is widened, multiplied in float32 and the result rounded to x's dtype once: the
  products of half-precision values are exact in float32 and a half-precision GEMM accumulates in
  float32 too, so this is that GEMM up to the order of its sums, at twice the weight's memory.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

PACK_BATCH_HINT = 32  # the batch oneDNN picks the packed layout for; any batch multiplies correctly


class CpuWeight(Protocol):
    tensor: torch.Tensor  # what the layout holds (the only copy of the weight the matmul reads)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...  # [T, in] -> [T, out]


def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies `dtype` packed on this CPU: bfloat16 with AVX-512 BF16 or AMX (not on an
    AVX2-only CPU, nor under ONEDNN_MAX_CPU_ISA=AVX2)."""
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def should_widen(dtype: torch.dtype) -> bool:
    """Whether `dtype` weights multiply faster widened to float32 here: half precision without this CPU's
    native dot products for it (bfloat16 that oneDNN cannot pack; float16 without AVX-512 FP16 or AMX)."""
    if dtype == torch.float16:
        return not torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return dtype == torch.bfloat16 and not can_pack(dtype)


class PackedWeight:
    def __init__(self, weight: torch.Tensor) -> None:  # [out, in] -> the same, oneDNN's opaque layout
        self.tensor: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.tensor, bias, "none", [], "")
        return out


class WidenedWeight:
    def __init__(self, weight: torch.Tensor) -> None:  # [out, in] half -> float32, strides (1, out)
        self.tensor = weight.float().t().contiguous().t()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        wide_bias = None if bias is None else bias.float()
        return F.linear(x.float(), self.tensor, wide_bias).to(x.dtype)
