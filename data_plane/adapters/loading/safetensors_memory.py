"""Tensors of a safetensors file already in memory, as views of its buffer (no copy), and the same reader
interface over a file on disk (safetensors' own `safe_open`), so that the PEFT loader reads either alike.

Why not `safetensors.torch.load(bytes)`: it copies every tensor twice (into `bytes`, then into a
`bytearray`; docs/performance.md#artifacts). A fetched adapter arrives in one buffer whose sha256
the engine has just checked (adapters/artifacts/download.py); the tensors are views of that buffer, which the
caller never writes again.

The header is checked as safetensors checks it (format: an 8-byte little-endian header length, a JSON
object `{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__"?: {str: str}}`, then the
data): the header inside the buffer, every dtype known, each tensor's span exactly its shape's bytes,
and the spans tiling the data from 0 to its end with no gap or overlap. Any violation is a
SafetensorError, as a bad file is for `safe_open`.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open

from data_plane.adapters.artifacts.buffers import Buffer

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}



class TensorReader(Protocol):
    def keys(self) -> list[str]: ...

    def shape(self, key: str) -> list[int]: ...

    def get_tensor(self, key: str) -> torch.Tensor: ...


class Span:
    """Where one tensor lies in the file's bytes."""

    __slots__ = ("dtype", "shape", "start", "nbytes")

    def __init__(self, dtype: torch.dtype, shape: list[int], start: int, nbytes: int) -> None:
        self.dtype, self.shape, self.start, self.nbytes = dtype, shape, start, nbytes


class BufferTensors:
    """The tensors of the safetensors bytes in `buffer` (kept alive by the tensors it hands out)."""

    def __init__(self, buffer: Buffer) -> None:
        self._buffer = buffer
        self._spans = parse_header(memoryview(buffer))

    def keys(self) -> list[str]:
        return list(self._spans)

    def shape(self, key: str) -> list[int]:
        return list(self._spans[key].shape)

    def get_tensor(self, key: str) -> torch.Tensor:
        return span_tensor(self._buffer, self._spans[key])


def span_tensor(buffer: Buffer, span: Span) -> torch.Tensor:
    """The tensor at `span` of `buffer`: a view of it (a copy only when misaligned)."""
    numel = math.prod(span.shape)
    if numel == 0:
        return torch.empty(span.shape, dtype=span.dtype)
    itemsize = torch.empty((), dtype=span.dtype).element_size()
    if span.start % itemsize:  # a misaligned tensor (mixed dtypes): copied, as safe_open would
        data: bytearray = bytearray(memoryview(buffer)[span.start:span.start + span.nbytes])
        return torch.frombuffer(data, dtype=span.dtype, count=numel).view(span.shape)
    return torch.frombuffer(buffer, dtype=span.dtype, count=numel, offset=span.start).view(span.shape)


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


class _FileTensors:
    """safe_open's handle behind the same three calls."""

    def __init__(self, handle: object) -> None:
        self._f = handle

    def keys(self) -> list[str]:
        return list(self._f.keys())  # type: ignore[attr-defined]

    def shape(self, key: str) -> list[int]:
        return list(self._f.get_slice(key).get_shape())  # type: ignore[attr-defined]

    def get_tensor(self, key: str) -> torch.Tensor:
        return self._f.get_tensor(key)  # type: ignore[attr-defined]


@contextmanager
def open_tensors(source: Path | Buffer) -> Iterator[TensorReader]:
    """A reader over a file (mapped by safetensors) or over verified bytes in memory."""
    if not isinstance(source, Path):
        yield BufferTensors(source)
        return
    with safe_open(str(source), framework="pt") as f:
        yield _FileTensors(f)


def parse_header(data: memoryview) -> dict[str, Span]:
    if len(data) < 8:
        raise SafetensorError("the file is shorter than a safetensors header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES or 8 + n > len(data):
        raise SafetensorError(f"the header length {n} lies outside the file ({len(data)} bytes)")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SafetensorError(f"the header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorError("the header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise SafetensorError("__metadata__ must map strings to strings")
    base = 8 + n
    spans: dict[str, tuple[int, int, Span]] = {}
    for key, info in header.items():
        spans[key] = _span(key, info, base)
    end = 0
    for begin, stop, _ in sorted(spans.values(), key=lambda s: (s[0], s[1])):
        if begin != end:
            raise SafetensorError(f"tensor data is not contiguous at offset {begin} (expected {end})")
        end = stop
    if base + end != len(data):
        raise SafetensorError(f"the tensors end at byte {base + end}, the file at {len(data)}")
    return {key: span for key, (_, _, span) in spans.items()}


def _span(key: str, info: object, base: int) -> tuple[int, int, Span]:
    if not isinstance(info, dict):
        raise SafetensorError(f"tensor {key}: its entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise SafetensorError(f"tensor {key}: unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise SafetensorError(f"tensor {key}: the shape must be a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)
            and offsets[0] <= offsets[1]):
        raise SafetensorError(f"tensor {key}: data_offsets must be [begin, end] with 0 <= begin <= end")
    torch_dtype = DTYPES[dtype]
    nbytes = math.prod(shape) * torch.empty((), dtype=torch_dtype).element_size()
    if offsets[1] - offsets[0] != nbytes:
        raise SafetensorError(f"tensor {key}: {offsets[1] - offsets[0]} bytes for shape {shape} of {dtype} "
                              f"({nbytes} expected)")
    return offsets[0], offsets[1], Span(torch_dtype, shape, base + offsets[0], nbytes)
