"""BufferTensors against safetensors itself (the oracle): the same tensors from the same bytes, and every
malformed file safetensors refuses is refused here too, before any tensor is made."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import SafetensorError, deserialize
from safetensors.torch import load, save

from data_plane.adapters.loading.safetensors_memory import TORCH_DTYPES, BufferTensors
from shared.safetensors_header import DTYPES


def test_tensors_equal_safetensors_own_and_are_views_of_the_buffer() -> None:
    tensors = {"a_int8": torch.arange(-5, 6, dtype=torch.int8),  # 11 bytes: what follows is misaligned
               "b_f32": torch.randn(3, 5), "c_f16": torch.randn(4, 2).half(), "d_bf16": torch.randn(7).bfloat16(),
               "e_empty": torch.zeros(0, 3), "f_f64": torch.randn(2, 2).double()}
    data = save(tensors)
    expected = load(data)
    buffer = bytearray(data)
    ours = BufferTensors(buffer)
    assert sorted(ours.keys()) == sorted(expected)
    for key, tensor in expected.items():
        got = ours.get_tensor(key)
        assert ours.shape(key) == list(tensor.shape) and got.dtype == tensor.dtype
        assert torch.equal(got, tensor), key
    aligned = ours.get_tensor("b_f32")
    if aligned.data_ptr() % 4 == 0:  # aligned spans are views, not copies
        base = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
        assert base <= aligned.data_ptr() < base + len(buffer)


def test_each_dtype_of_the_shared_table_has_its_torch_dtype() -> None:
    assert TORCH_DTYPES.keys() == DTYPES.keys()
    for name, dtype in TORCH_DTYPES.items():
        assert (DTYPES[name].itemsize, DTYPES[name].floating) == (dtype.itemsize, dtype.is_floating_point), name


def _file(header: object, data: bytes, length: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


F32_2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
MALFORMED = {
    "shorter than the length": b"\x01\x02",
    "header length past the end": _file({"t": F32_2}, b"\0" * 8, length=10_000),
    "not an object": _file([1, 2], b""),
    "data cut short": _file({"t": F32_2}, b"\0" * 7),
    "trailing bytes": _file({"t": F32_2}, b"\0" * 9),
    "span not the shape's bytes": _file({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
    "a gap": _file({"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
    "overlap": _file({"t": F32_2, "u": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
    "unknown dtype": _file({"t": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
    "negative dim": _file({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8),
    "reversed offsets": _file({"t": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}, b"\0" * 8),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_what_safetensors_refuses_is_refused(name: str) -> None:
    data = MALFORMED[name]
    with pytest.raises(Exception):  # noqa: B017, PT011 - the oracle: safetensors' own parser refuses it
        deserialize(data)
    with pytest.raises(SafetensorError):
        BufferTensors(bytearray(data))
