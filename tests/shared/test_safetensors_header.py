"""shared.safetensors_header against safetensors itself (the oracle): a file it writes parses to the
same tensors (names, dtypes, shapes, bytes), in memory and from a path; a file it refuses is refused
here too, with a HeaderError (a ValueError) saying why."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import deserialize, safe_open
from safetensors.numpy import save as save_numpy
from safetensors.torch import save, save_file

from shared.safetensors_header import DTYPES, MAX_HEADER_BYTES, HeaderError, header_length, parse, read_header

TORCH = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
         "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
         "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _tensors() -> dict[str, torch.Tensor]:
    """One tensor of every dtype of DTYPES (an odd-sized int8 first: what follows is misaligned), an empty
    one and a scalar."""
    out = {"a_int8": torch.arange(-5, 6, dtype=torch.int8)}
    for i, (name, dtype) in enumerate(TORCH.items()):
        out[f"t{i}_{name}"] = (torch.randn(3, 5) * 10).to(dtype)
    out["z_empty"], out["z_scalar"] = torch.zeros(0, 3), torch.tensor(2.5)
    return out


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""


def test_the_table_covers_the_dtypes_tested() -> None:
    assert set(TORCH) == set(DTYPES)


def test_files_safetensors_writes_parse_to_its_tensors(tmp_path: Path) -> None:
    tensors = _tensors()
    path = tmp_path / "t.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    data = path.read_bytes()
    in_memory, from_file = parse(bytearray(data)), read_header(path)
    assert in_memory == from_file == parse(data) == parse(memoryview(data))
    with safe_open(str(path), framework="pt") as f:
        assert sorted(in_memory) == sorted(f.keys())
        for key in f.keys():  # noqa: SIM118 - safe_open's handle is no mapping
            info, expected = in_memory[key], f.get_tensor(key)
            assert (info.dtype, list(info.shape)) == (f.get_slice(key).get_dtype(), f.get_slice(key).get_shape())
            assert data[info.start:info.start + info.nbytes] == _raw(expected), key
    assert header_length(data[:8]) + 8 == min(i.start for i in in_memory.values())
    assert parse(save({})) == {}  # no tensor at all


def _file(header: object, data: bytes, length: int | None = None, text: str | None = None) -> bytes:
    raw = (json.dumps(header) if text is None else text).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


F32_2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
HUGE = "9" * 5000  # Python's json refuses an integer of over 4300 digits with a plain ValueError
MALFORMED = {
    "shorter than the length": b"\x01\x02",
    "header length past the end": _file({"t": F32_2}, b"\0" * 8, length=10_000),
    "header length over the limit": _file({"t": F32_2}, b"\0" * 8, length=MAX_HEADER_BYTES + 1),
    "empty header": _file({}, b"", text=""),
    "not JSON": _file(None, b"", text="{not json"),
    "not UTF-8": struct.pack("<Q", 4) + b"\xff\xfe{}",
    "UTF-16 JSON": (lambda raw: struct.pack("<Q", len(raw)) + raw)('{"t": {}}'.encode("utf-16")),
    "an integer of 5000 digits": _file(None, b"", text='{"t": {"dtype": "F32", "shape": [' + HUGE + '], '
                                                     '"data_offsets": [0, 0]}}'),
    "nesting too deep": _file(None, b"", text='{"t": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    "not an object": _file([1, 2], b""),
    "an entry not an object": _file({"t": [1]}, b""),
    "metadata not strings": _file({"__metadata__": {"a": 1}}, b""),
    "data cut short": _file({"t": F32_2}, b"\0" * 7),
    "trailing bytes": _file({"t": F32_2}, b"\0" * 9),
    "span not the shape's bytes": _file({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
    "a gap": _file({"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
    "overlap": _file({"t": F32_2, "u": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
    "same span twice": _file({"t": F32_2, "u": F32_2}, b"\0" * 8),
    "unknown dtype": _file({"t": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
    "no dtype": _file({"t": {"shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
    "negative dim": _file({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8),
    "float dim": _file({"t": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, b"\0" * 8),
    "bool dim": _file({"t": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"\0"),
    "dim past 64 bits": _file({"t": {"dtype": "U8", "shape": [2**64], "data_offsets": [0, 0]}}, b""),
    "element count past 64 bits": _file({"t": {"dtype": "U8", "shape": [2**40, 2**40, 0], "data_offsets": [0, 0]}},
                                        b""),
    "reversed offsets": _file({"t": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}, b"\0" * 8),
    "three offsets": _file({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 8]}}, b"\0" * 8),
    "offsets past 64 bits": _file({"t": {"dtype": "U8", "shape": [0], "data_offsets": [2**64, 2**64]}}, b""),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_what_safetensors_refuses_is_refused(name: str, tmp_path: Path) -> None:
    data = MALFORMED[name]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    with pytest.raises(Exception):  # noqa: B017, PT011 - the oracle: safetensors' own parser refuses it
        deserialize(data)
    with pytest.raises(Exception), safe_open(str(path), framework="pt"):  # noqa: B017, PT011
        pass
    with pytest.raises(HeaderError) as in_memory:
        parse(data)
    with pytest.raises(HeaderError) as from_file:
        read_header(path)
    assert str(in_memory.value) == str(from_file.value) and isinstance(in_memory.value, ValueError)


def test_what_safetensors_accepts_at_the_edges_is_accepted() -> None:
    for data in (_file({"__metadata__": None}, b""),  # null metadata: none
                 _file({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "extra": 1}}, b"\0" * 8),
                 _file({"e": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, "t": F32_2}, b"\0" * 8)):
        expected = {name: (info["dtype"], info["shape"]) for name, info in deserialize(data)}
        assert {k: (i.dtype, list(i.shape)) for k, i in parse(data).items()} == expected


@pytest.mark.parametrize(("message", "data"), [
    ("tensor u: its data starts at byte 4, expected 8", MALFORMED["overlap"]),
    ("tensor t: its data_offsets end at 8, past the end of the file's data (7 bytes; truncated?)",
     MALFORMED["data cut short"]),
    ("tensor t: 8 bytes for shape [3] of F32 (12 expected)", MALFORMED["span not the shape's bytes"]),
    ("the header holds an integer of over 4300 digits", MALFORMED["an integer of 5000 digits"]),
    ("the header length 10000 lies outside the file", MALFORMED["header length past the end"]),
])
def test_refusals_say_what_is_wrong_and_name_the_tensor(message: str, data: bytes) -> None:
    with pytest.raises(HeaderError, match=re.escape(message)):
        parse(data)


def test_dtypes_safetensors_has_but_loraplane_does_not_read_are_refused_as_unknown() -> None:
    data = save_numpy({"x": np.zeros(3, dtype=np.uint16)})
    assert deserialize(data)[0][1]["dtype"] == "U16"  # valid for safetensors
    with pytest.raises(HeaderError, match="unknown dtype 'U16'"):
        parse(data)


def test_header_length_reads_the_first_eight_bytes_only() -> None:
    assert header_length(struct.pack("<Q", 1234) + b"rest") == 1234
    with pytest.raises(HeaderError, match="shorter than"):
        header_length(b"\x01\x02")
