"""The collectives: the only places a rank talks to the others.

All use the default process group (parallel_state.py creates it). The layers' all-reduce and all-gather
are never called when tp_size == 1, so the single-device path makes no torch.distributed call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def tensor_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum the partial results of all tensor-parallel ranks, in place (row-parallel linear, vocab-parallel
    embedding)."""
    dist.all_reduce(x)
    return x


def tensor_parallel_all_gather(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dim (vocab-parallel logits)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast_from_rank0(message: object = None) -> object:
    """Rank 0 sends `message` (any picklable object, tensors included); every rank returns it."""
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]
