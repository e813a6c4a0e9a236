"""Adapter weights from the API process to the engine core through shared memory, not the socket.

The API process copies every A and B of a validated adapter into one file under /dev/shm (one memcpy
per tensor) and sends only its layout (messages.SharedAdapter). The core maps the file, builds the
tensors as views of that mapping (no copy) and unlinks the file at once: the mapping keeps the memory
until the core drops the adapter, and nothing is left behind if either process dies later.

    file: [a_t of layer 0 module m0 | b_t … | … ], each tensor at a 64-byte aligned offset
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

import torch

from data_plane.engine.core.messages import ModuleRef, SharedAdapter, TensorRef
from data_plane.lora.weights import LoRAAdapterWeights, LoRAModuleWeights

_ALIGN = 64


def shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def file_prefix(owner_pid: int) -> str:
    """Files of one API process start with this: what it sweeps at shutdown (the core unlinks the rest)."""
    return f"loraplane-adapter-{owner_pid}-"


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def share_adapter(weights: LoRAAdapterWeights) -> SharedAdapter:
    """Copy the adapter's tensors into a new shared file; returns its layout."""
    tensors = [t for modules in weights.layers.values() for m in modules.values() for t in (m.a_t, m.b_t)]
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"an adapter's tensors share one dtype; found {sorted(map(str, dtypes))}")
    dtype = dtypes.pop() if dtypes else torch.float32
    offsets, size = [], 0
    for t in tensors:
        offsets.append(size)
        size = _aligned(size + t.numel() * t.element_size())
    path = shm_dir() / f"{file_prefix(os.getpid())}{uuid.uuid4().hex}"
    with path.open("wb") as f:
        f.truncate(max(size, 1))
    buf = torch.from_file(str(path), shared=True, size=max(size, 1), dtype=torch.uint8)
    refs: list[TensorRef] = []
    for t, offset in zip(tensors, offsets, strict=True):
        nbytes = t.numel() * t.element_size()
        buf[offset : offset + nbytes].view(dtype).view(t.shape).copy_(t)
        refs.append(TensorRef(offset, list(t.shape)))
    del buf
    layers: dict[int, dict[str, ModuleRef]] = {}
    pairs = iter(refs)
    for index, modules in weights.layers.items():
        layers[index] = {name: ModuleRef(next(pairs), next(pairs), m.scaling) for name, m in modules.items()}
    return SharedAdapter(
        file=str(path), size=max(size, 1), dtype=str(dtype).removeprefix("torch."), path=weights.path,
        sha256=weights.sha256, rank=weights.rank, alpha=weights.alpha, target_modules=list(weights.target_modules),
        size_bytes=weights.size_bytes, layers=layers,
    )


def open_adapter(shared: SharedAdapter) -> LoRAAdapterWeights:
    """In the core: the adapter as views of the shared file, which is unlinked here."""
    try:
        buf = torch.from_file(shared.file, shared=True, size=shared.size, dtype=torch.uint8)
    finally:
        Path(shared.file).unlink(missing_ok=True)
    dtype = getattr(torch, shared.dtype)

    def view(ref: TensorRef) -> torch.Tensor:
        count = 1
        for dim in ref.shape:
            count *= dim
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        return buf[ref.offset : ref.offset + nbytes].view(dtype).view(ref.shape)

    layers = {
        index: {
            # lora_a / lora_b as PEFT stores them, transposed views of the input-major tensors: the
            # dataclass then finds a_t / b_t contiguous already and copies nothing
            name: LoRAModuleWeights(lora_a=view(m.a_t).T, lora_b=view(m.b_t).T, scaling=m.scaling)
            for name, m in modules.items()
        }
        for index, modules in shared.layers.items()
    }
    return LoRAAdapterWeights(
        path=shared.path, sha256=shared.sha256, rank=shared.rank, alpha=shared.alpha,
        target_modules=list(shared.target_modules), size_bytes=shared.size_bytes, layers=layers,
    )


def sweep(owner_pid: int) -> None:
    """Remove the shared files this process wrote that no core picked up (the core died first)."""
    for path in shm_dir().glob(file_prefix(owner_pid) + "*"):
        path.unlink(missing_ok=True)
