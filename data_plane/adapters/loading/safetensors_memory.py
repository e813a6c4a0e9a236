"""Tensors of a safetensors file already in memory, as views of its buffer (no copy), and the same reader
interface over a file on disk (safetensors' own `safe_open`), so that the PEFT loader reads either alike.

Why not `safetensors.torch.load(bytes)`: it copies every tensor twice (into `bytes`, then into a
`bytearray`; docs/performance.md#artifacts). A fetched adapter arrives in one buffer whose sha256
the engine has just checked (adapters/artifacts/download.py); the tensors are views of that buffer, which the
caller never writes again.

The header is parsed and checked by shared.safetensors_header (every check safetensors makes); here
each tensor becomes a torch view of the buffer. Any violation is a SafetensorError, as a bad file is for
`safe_open`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open

from data_plane.adapters.artifacts.buffers import Buffer
from shared.safetensors_header import DTYPES, HeaderError, TensorInfo, parse

# the torch dtype of each of shared.safetensors_header.DTYPES
TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class TensorReader(Protocol):
    def keys(self) -> list[str]: ...

    def shape(self, key: str) -> list[int]: ...

    def get_tensor(self, key: str) -> torch.Tensor: ...


class BufferTensors:
    """The tensors of the safetensors bytes in `buffer` (kept alive by the tensors it hands out)."""

    def __init__(self, buffer: Buffer) -> None:
        self._buffer = buffer
        try:
            self._spans = parse(buffer)
        except HeaderError as exc:
            raise SafetensorError(str(exc)) from None

    def keys(self) -> list[str]:
        return list(self._spans)

    def shape(self, key: str) -> list[int]:
        return list(self._spans[key].shape)

    def get_tensor(self, key: str) -> torch.Tensor:
        return span_tensor(self._buffer, self._spans[key])


def span_tensor(buffer: Buffer, span: TensorInfo) -> torch.Tensor:
    """The tensor at `span` of `buffer`: a view of it (a copy only when misaligned)."""
    numel, dtype = math.prod(span.shape), TORCH_DTYPES[span.dtype]
    if numel == 0:
        return torch.empty(span.shape, dtype=dtype)
    if span.start % DTYPES[span.dtype].itemsize:  # a misaligned tensor (mixed dtypes): copied, as safe_open would
        data: bytearray = bytearray(memoryview(buffer)[span.start:span.start + span.nbytes])
        return torch.frombuffer(data, dtype=dtype, count=numel).view(span.shape)
    return torch.frombuffer(buffer, dtype=dtype, count=numel, offset=span.start).view(span.shape)


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in `tensor`: its min and max (one pass that allocates nothing; NaN propagates
    through both) are finite. `isfinite(t).all()` would build a bool tensor as long as the weights first
    (docs/performance.md#artifacts)."""
    if tensor.numel() == 0:
        return True
    if tensor.dtype.itemsize == 1:  # float8: no min/max kernels
        return bool(torch.isfinite(tensor.float()).all())
    lo, hi = torch.aminmax(tensor)
    return math.isfinite(lo.item()) and math.isfinite(hi.item())


class _SafeSlice(Protocol):
    def get_shape(self) -> list[int]: ...


class _SafeOpenHandle(Protocol):
    """What _FileTensors calls of safe_open's handle (safetensors' stub leaves these calls unannotated)."""

    def keys(self) -> list[str]: ...

    def get_slice(self, name: str) -> _SafeSlice: ...

    def get_tensor(self, name: str) -> torch.Tensor: ...


class _FileTensors:
    """safe_open's handle behind the same three calls."""

    def __init__(self, handle: _SafeOpenHandle) -> None:
        self._f = handle

    def keys(self) -> list[str]:
        return list(self._f.keys())

    def shape(self, key: str) -> list[int]:
        return list(self._f.get_slice(key).get_shape())

    def get_tensor(self, key: str) -> torch.Tensor:
        return self._f.get_tensor(key)


@contextmanager
def open_tensors(source: Path | Buffer) -> Iterator[TensorReader]:
    """A reader over a file (mapped by safetensors) or over verified bytes in memory."""
    if not isinstance(source, Path):
        yield BufferTensors(source)
        return
    with safe_open(str(source), framework="pt") as f:
        yield _FileTensors(f)

