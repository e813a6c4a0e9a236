"""Accelerator selection: cpu, cuda or npu (Ascend, through the optional torch_npu plugin)."""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch


def _npu_available() -> bool:
    """torch_npu registers torch.npu on import; only import it when it is installed."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    importlib.import_module("torch_npu")
    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


def resolve_device(name: str = "auto") -> torch.device:
    """"auto" = cuda if available, else npu if torch_npu is installed and sees a device, else cpu.

    An explicit "cuda[:N]" or "npu[:N]" that is not usable raises ValueError naming what is missing.
    """
    kind = name.split(":", 1)[0]
    if kind == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _npu_available():
            return torch.device("npu")
        return torch.device("cpu")
    if kind == "cpu":
        return torch.device(name)
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} requested but CUDA is not available")
        return torch.device(name)
    if kind == "npu":
        if importlib.util.find_spec("torch_npu") is None:
            raise ValueError(f"device {name!r} requested but torch_npu is not installed (pip install loraplane[npu])")
        if not _npu_available():
            raise ValueError(f"device {name!r} requested but no NPU is available")
        return torch.device(name)
    raise ValueError(f"unknown device {name!r}; choose auto, cpu, cuda[:N] or npu[:N]")


def env_choice(variable: str, choices: tuple[str, ...]) -> str:
    """The value of a kernel switch such as LORAPLANE_ATTENTION_KERNELS: `choices[0]` (auto) when unset or
    blank; ValueError naming the variable and its choices otherwise."""
    choice = os.environ.get(variable, choices[0]).strip().lower() or choices[0]
    if choice not in choices:
        raise ValueError(f"{variable}={choice!r}: expected one of {', '.join(choices)}")
    return choice
