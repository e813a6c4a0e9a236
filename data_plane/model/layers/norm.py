"""RMSNorm, numerically Hugging Face's Llama/Qwen implementation, with the residual add fused in.

`forward(x)` normalizes; `add_forward(x, residual)` first adds `x` into the residual stream (Llama's
`h = h + f(h)`) and normalizes the sum, answering both. On the CPU, bfloat16/float16 rows of [T, hidden]
run through a compiled kernel when one is set (`kernel`, chosen at load by norm_kernels.py): one pass per
row instead of six ops, the same roundings, the squares summed in another order (so a value may differ
by one unit in the last place). Everything else, float32 included, takes the torch ops.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from data_plane.model.layers.parallel import default_weight_loader, new_parameter, set_weight_loader

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


class RMSNormKernel(Protocol):
    """The compiled ops (norm_kernels.py loads them); every tensor a contiguous CPU tensor of one dtype."""

    def rms_norm(self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None: ...

    def add_rms_norm(self, out: torch.Tensor, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> None: ...  # residual += x (rounded), in place


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter(hidden_size)
        set_weight_loader(self.weight, default_weight_loader)
        self.kernel: RMSNormKernel | None = None  # None: the torch ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., hidden]
        if self._kernel_serves(x):
            assert self.kernel is not None
            out = torch.empty_like(x)
            self.kernel.rms_norm(out, x, self.weight, self.eps)
            return out
        # same op order as HF: normalize in float32, cast back to the input dtype, then scale
        input_dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(input_dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x) for x, residual [T, hidden]; `residual` may be updated in place."""
        if self._kernel_serves(x) and self._kernel_serves(residual):
            assert self.kernel is not None
            out = torch.empty_like(x)
            self.kernel.add_rms_norm(out, residual, x, self.weight, self.eps)
            return out, residual
        summed = residual + x
        return self.forward(summed), summed

    def _kernel_serves(self, x: torch.Tensor) -> bool:
        return (self.kernel is not None and x.dtype in KERNEL_DTYPES and x.dtype == self.weight.dtype
                and x.dim() == 2 and x.is_contiguous() and x.device.type == "cpu")

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
