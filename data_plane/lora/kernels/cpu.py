"""The CPU decode kernels (bgmv_cpu.cpp), compiled on first use with torch's cpp_extension.

How and where it is built: data_plane/model/cpu_extension.py (LORAPLANE_KERNEL_BUILD_DIR). Without a
compiler or ninja, or when the build fails, `load_cpu_kernels` answers None once with a warning and the
pure-torch ops serve.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from data_plane.lora.ops import Lanes, TorchKernels
from data_plane.model.cpu_extension import build_cpu_extension

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bgmv_cpu.cpp")


class CPUKernels(TorchKernels):
    """BGMV shrink and expand read each slot in place (semantics in bgmv_cpu.cpp's header); prefill
    segments keep torch's matmul per segment, which reads its slot in place already."""

    def __init__(self) -> None:
        self._ops = torch.ops.loraplane_lora

    def bgmv_shrink(self, v: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, index: torch.Tensor,
                    slots: torch.Tensor, num_lanes: int, rank: int, rows_from_zero: bool = False) -> None:
        """v[index[i]] = x[index[i]] @ A[slots[i]] per lane, the first `rank` columns of each."""
        self._ops.bgmv_shrink(v, x, lora_a, index, slots, num_lanes, rank)

    def bgmv_expand(self, y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, index: torch.Tensor,
                    slots: torch.Tensor, lanes: Lanes, rank: int, rows_from_zero: bool = False) -> None:
        """y[index[i], cols_l] += v[index[i], lane l's block] @ B[slots[i], :rank, cols_l]."""
        offsets, widths = zip(*lanes, strict=True)
        self._ops.bgmv_expand(y, v, lora_b, index, slots, list(offsets), list(widths), rank)


@functools.cache
def load_cpu_kernels() -> CPUKernels | None:
    """The compiled kernels, or None (logged once) when they cannot be built here."""
    if not build_cpu_extension("lora_bgmv", SOURCE, "LoRA CPU kernels", "the pure-torch LoRA ops", logger):
        return None
    return CPUKernels()
