"""Creating and tearing down the tensor-parallel process group.

Backend per device: gloo on CPU, nccl on CUDA, hccl on Ascend NPU. One group holds every rank; rank 0
runs the API and the scheduler, the others only follow its broadcasts (data_plane/engine/tp_group.py).
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

# a rank that stops answering fails collectives after this long instead of hanging the engine forever
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


def backend_for(device: torch.device) -> str:
    return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[device.type]


def free_tcp_init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def init_group(rank: int, world_size: int, device: torch.device, init_method: str) -> None:
    if device.type == "npu":
        import torch_npu  # noqa: F401  (registers the hccl backend)
    dist.init_process_group(
        backend_for(device), init_method=init_method, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
    )


def set_cpu_threads(num_threads: int | None, tp_size: int) -> None:
    """Intra-op threads of this rank: as configured, else the cores split among the ranks on CPU, so
    that N ranks do not each start one thread per core and thrash (docs/performance.md#tensor-parallel)."""
    if num_threads:
        torch.set_num_threads(num_threads)
    elif tp_size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp_size))


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
