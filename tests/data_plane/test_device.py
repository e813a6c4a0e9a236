"""Device selection: explicit names, auto, and clear errors for unusable accelerators."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from data_plane.device import resolve_device


def test_cpu_and_auto():
    assert resolve_device("cpu") == torch.device("cpu")
    auto = resolve_device()
    assert auto.type in ("cpu", "cuda", "npu")
    if torch.cuda.is_available():
        assert auto.type == "cuda"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")
def test_cuda_unavailable_is_an_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda:0")


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu installed")
def test_npu_without_torch_npu_is_an_error():
    with pytest.raises(ValueError, match="torch_npu is not installed"):
        resolve_device("npu")


def test_unknown_device():
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu")
