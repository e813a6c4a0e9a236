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

from data_plane.lora.ops import Lanes
from data_plane.model.cpu_extension import build_cpu_extension
from data_plane.model.lora_batch import LoRABatch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bgmv_cpu.cpp")


class CPUKernels:
    """LoRAKernels that read each slot in place (semantics in bgmv_cpu.cpp's header): one call per layer
    for every routed token of the step, decode tokens and prefill segments alike (LoRABatch.routed)."""

    def __init__(self) -> None:
        self._ops = torch.ops.loraplane_lora

    def shrink(self, v: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, batch: LoRABatch, num_lanes: int) -> None:
        index, slots = batch.routed(x.device)
        self._ops.bgmv_shrink(v, x, lora_a, index, slots, num_lanes, batch.rank)

    def expand(self, y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, batch: LoRABatch, lanes: Lanes) -> None:
        index, slots = batch.routed(y.device)
        offsets, widths = _columns(lanes)
        self._ops.bgmv_expand(y, v, lora_b, index, slots, offsets, widths, batch.rank)

    def shrink_expand(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      batch: LoRABatch, lanes: Lanes) -> None:
        index, slots = batch.routed(x.device)
        offsets, widths = _columns(lanes)
        self._ops.bgmv_shrink_expand(y, x, lora_a, lora_b, index, slots, len(lanes), batch.rank, offsets, widths)


def _columns(lanes: Lanes) -> tuple[list[int], list[int]]:
    """The lanes' first output columns and widths, as the ops take them."""
    return [offset for offset, _ in lanes], [width for _, width in lanes]


@functools.cache
def load_cpu_kernels() -> CPUKernels | None:
    """The compiled kernels, or None (logged once) when they cannot be built here."""
    if not build_cpu_extension("lora_bgmv", SOURCE, "LoRA CPU kernels", "the pure-torch LoRA ops", logger):
        return None
    return CPUKernels()
