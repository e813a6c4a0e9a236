"""The header of a safetensors file, read and checked as safetensors itself checks it, without torch.

Format: an 8-byte little-endian header length n, n bytes of UTF-8 JSON, an object
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__"?: {str: str}}`, then the data.
Checked (safetensors' `read_metadata` and `Metadata::validate`): the header lies in the file and is at
most MAX_HEADER_BYTES; it is a JSON object; `__metadata__`, if any, maps strings to strings; every dtype
is one of DTYPES; shapes and offsets are integers that fit 64 bits, begin <= end; each span holds exactly
its shape's bytes; sorted by offset, the spans tile the data from 0 to its end with no gap or overlap.
Any violation is a HeaderError naming the tensor where there is one. DTYPES lists the dtypes loraplane
reads (torch has each); safetensors knows a few more (U16, C64, F4, …), refused here as unknown.
The engine parses a verified file in memory (`parse`); the control plane reads only the header
(`read_header`).
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

Bytes = bytes | bytearray | memoryview | mmap.mmap
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
_USIZE = 1 << 64  # shapes and offsets are usize in safetensors: larger is an overflow it refuses


class DType(NamedTuple):
    itemsize: int  # bytes per element
    floating: bool


DTYPES: dict[str, DType] = {
    "F64": DType(8, True), "F32": DType(4, True), "F16": DType(2, True), "BF16": DType(2, True),
    "F8_E4M3": DType(1, True), "F8_E5M2": DType(1, True),
    "I64": DType(8, False), "I32": DType(4, False), "I16": DType(2, False), "I8": DType(1, False),
    "U8": DType(1, False), "BOOL": DType(1, False),
}


class HeaderError(ValueError):
    """The bytes are not a valid safetensors file (the message says why)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: its dtype name (a key of DTYPES), shape, and where its bytes lie: `start`
    is the offset of the first in the file (whose data begins after the 8-byte length and the header)."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int


def header_length(prefix: Bytes) -> int:
    """The header's length in bytes, from the file's first 8 bytes."""
    if len(prefix) < 8:
        raise HeaderError("the file is shorter than a safetensors header length (8 bytes)")
    return int(struct.unpack("<Q", prefix[:8])[0])


def parse(data: Bytes) -> dict[str, TensorInfo]:
    """The tensors of a whole safetensors file held in `data`, by name."""
    with memoryview(data) as view:
        n = _checked_length(view, len(view))
        raw, size = bytes(view[8:8 + n]), len(view)
    return _tensors(raw, 8 + n, size - 8 - n)


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """The tensors of the safetensors file at `path`, by name, reading only its header (OSError as
    reading raises it)."""
    with Path(path).open("rb") as fh:
        size = fh.seek(0, 2)
        fh.seek(0)
        n = _checked_length(fh.read(8), size)
        raw = fh.read(n)
    if len(raw) != n:  # the file shrank since its size was taken
        raise HeaderError(f"the header length {n} lies outside the file")
    return _tensors(raw, 8 + n, size - 8 - n)


def _checked_length(prefix: Bytes, size: int) -> int:
    n = header_length(prefix)
    if n > MAX_HEADER_BYTES:
        raise HeaderError(f"the header length {n} is over safetensors' limit of {MAX_HEADER_BYTES} bytes")
    if 8 + n > size:
        raise HeaderError(f"the header length {n} lies outside the file ({size} bytes)")
    return n


def _tensors(raw: bytes, base: int, data_size: int) -> dict[str, TensorInfo]:
    """The tensors the header `raw` describes, their data starting at byte `base` and `data_size` long."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # the message gives a position, not the text
        raise HeaderError(f"the header is not valid JSON ({exc})") from None
    except ValueError:  # Python's json refuses integers of over 4300 digits with a plain ValueError
        raise HeaderError("the header holds an integer of over 4300 digits") from None
    except RecursionError:
        raise HeaderError("the header's JSON nests too deeply") from None
    if not isinstance(header, dict):
        raise HeaderError("the header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise HeaderError("__metadata__ must map strings to strings")
    spans = sorted((_offsets(key, info), key) for key, info in header.items())
    end = 0
    for (begin, stop), key in spans:
        if stop > data_size:
            raise HeaderError(f"tensor {key}: its data_offsets end at {stop}, past the end of the file's data "
                              f"({data_size} bytes; truncated?)")
        if begin != end:
            raise HeaderError(f"tensor {key}: its data starts at byte {begin}, expected {end} (the tensors' data "
                              f"must follow one another with no gap or overlap)")
        end = stop
    if end != data_size:
        raise HeaderError(f"the tensors' data ends at byte {end}, the file's at {data_size} (past the header)")
    return {key: TensorInfo(header[key]["dtype"], tuple(header[key]["shape"]), base + begin, stop - begin)
            for (begin, stop), key in spans}


def _offsets(key: str, info: object) -> tuple[int, int]:
    """`info`'s data_offsets, after checking the entry against its dtype and shape."""
    if not isinstance(info, dict):
        raise HeaderError(f"tensor {key}: its entry is not a JSON object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise HeaderError(f"tensor {key}: unknown dtype {str(dtype)[:40]!r} (known: {', '.join(DTYPES)})")
    if not (isinstance(shape, list) and all(_usize(d) for d in shape)):
        raise HeaderError(f"tensor {key}: the shape must be a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_usize(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise HeaderError(f"tensor {key}: data_offsets must be [begin, end] with 0 <= begin <= end")
    count = 1
    for d in shape:
        count *= d
        if count >= _USIZE:
            raise HeaderError(f"tensor {key}: the shape's element count overflows 64 bits")
    nbytes = count * DTYPES[dtype].itemsize
    if nbytes * 8 >= _USIZE:
        raise HeaderError(f"tensor {key}: the shape's size in bits overflows 64 bits")
    if offsets[1] - offsets[0] != nbytes:
        raise HeaderError(f"tensor {key}: {offsets[1] - offsets[0]} bytes for shape {shape} of {dtype} "
                          f"({nbytes} expected)")
    return offsets[0], offsets[1]


def _usize(value: object) -> bool:
    return type(value) is int and 0 <= value < _USIZE
