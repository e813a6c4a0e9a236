"""Tensor-parallel helpers shared by the layers: shard arithmetic and shape-checked weight copies.

The collectives the layers call live in data_plane/distributed/collectives.py.
"""

from __future__ import annotations

import torch
from torch import nn

# which part of a fused parameter a checkpoint tensor fills: an output index (gate/up) or "q"/"k"/"v"
ShardId = int | str | None


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp_size ({denominator})")
    return numerator // denominator


def new_parameter(*shape: int) -> nn.Parameter:
    """An uninitialized inference parameter: the loader overwrites every value, so a random init would only
    cost time; dtype and device come from the torch defaults the loader sets while building the model."""
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape {tuple(src.shape)} does not match the expected {tuple(dst.shape)}")
    dst.copy_(src)


def check_full_shape(loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    """Compare the checkpoint tensor with the full (unsharded) shape before slicing out this rank's part."""
    if tuple(loaded.shape) != expected:
        raise ValueError(f"shape {tuple(loaded.shape)} does not match the expected {expected}")


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
    """Replicated parameters (norms): every rank holds the full tensor."""
    copy_checked(param.data, loaded_weight)
