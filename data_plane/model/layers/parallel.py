"""Tensor-parallel helpers shared by the layers: shard arithmetic and shape-checked weight copies.

The collectives the layers call live in data_plane/distributed/collectives.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# which part of a fused parameter a checkpoint tensor fills: an output index (gate/up) or "q"/"k"/"v"
ShardId = int | str | None
# copies this rank's slice of a full checkpoint tensor into the parameter: (param, loaded_weight, shard_id)
WeightLoader = Callable[[nn.Parameter, torch.Tensor, ShardId], None]


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp_size ({denominator})")
    return numerator // denominator


def new_parameter(*shape: int) -> nn.Parameter:
    """An uninitialized inference parameter: the loader overwrites every value, so a random init would only
    cost time; dtype and device come from the torch defaults the loader sets while building the model."""
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    """Attach `loader` to `param` as its `weight_loader` attribute (data_plane/model/weights.py calls it)."""
    # setattr: an attribute of this instance only, which nn.Parameter's type does not declare
    setattr(param, "weight_loader", loader)  # noqa: B010


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
