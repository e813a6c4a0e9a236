"""RMSNorm, numerically identical to the Hugging Face Llama/Qwen implementation."""

from __future__ import annotations

import torch
from torch import nn

from data_plane.model.layers.parallel import default_weight_loader, new_parameter, set_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter(hidden_size)
        set_weight_loader(self.weight, default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., hidden]
        # same op order as HF: normalize in float32, cast back to the input dtype, then scale
        input_dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
