"""Tensor-parallel helpers shared by the layers: shard arithmetic, shape-checked weight copies, collectives.

World size is 1 today. The collectives below are the only places a layer talks to other ranks;
they are never called when tp_size == 1, so the single-device path makes no torch.distributed call.
"""

from __future__ import annotations

import torch
from torch import nn

from data_plane.distributed.comm_stats import timed_collective


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


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    """Replicated parameters (norms): every rank holds the full tensor."""
    copy_checked(param.data, loaded_weight)


def tensor_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """TP hook: sum the partial results of all tensor-parallel ranks (row-parallel linear, vocab-parallel
    embedding). Uses the default process group; data_plane/distributed owns its creation."""
    import torch.distributed as dist

    with timed_collective():
        dist.all_reduce(x)
    return x


def tensor_parallel_all_gather(x: torch.Tensor) -> torch.Tensor:
    """TP hook: concatenate each rank's shard along the last dim (vocab-parallel logits)."""
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    with timed_collective():
        dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
