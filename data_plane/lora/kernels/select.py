"""Which LoRA kernels a device's layers run: LORAPLANE_LORA_KERNELS=auto (default) or torch.

auto: the compiled CPU kernels on the CPU, Triton on CUDA when it is installed, the pure-torch ops
everywhere else (the NPU, and wherever the others cannot load; each says why once in the log).
torch: the pure-torch ops on every device, e.g. to compare against them or to rule the kernels out.
"""

from __future__ import annotations

import functools
import logging

import torch

from data_plane.device import env_choice
from data_plane.lora.ops import TORCH_KERNELS, LoRAKernels

logger = logging.getLogger(__name__)

KERNELS_ENV = "LORAPLANE_LORA_KERNELS"
CHOICES = ("auto", "torch")


def select_kernels(device: torch.device) -> LoRAKernels:
    choice = env_choice(KERNELS_ENV, CHOICES)
    if choice == "torch":
        return TORCH_KERNELS
    return _auto(device.type) or TORCH_KERNELS


@functools.cache
def _auto(device_type: str) -> LoRAKernels | None:
    if device_type == "cpu":
        from data_plane.lora.kernels.cpu import load_cpu_kernels

        return load_cpu_kernels()
    if device_type == "cuda":
        from data_plane.lora.kernels.triton_ops import load_triton_kernels

        return load_triton_kernels()
    return None  # the NPU (torch_npu) and the rest: the pure-torch ops
