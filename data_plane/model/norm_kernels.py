"""Which RMSNorm the model's norms run: LORAPLANE_NORM_KERNELS=auto (default) or torch.

auto: on the CPU the compiled kernel (rms_norm_cpu.cpp) for bfloat16/float16 rows, which also
fuses the residual add; where it cannot be built (said once in the log), and on other devices and for
float32, the torch ops. torch: the torch ops everywhere, e.g. to compare against them.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
from torch import nn

from data_plane.device import env_choice
from data_plane.model.cpu_extension import build_cpu_extension
from data_plane.model.layers.norm import KERNEL_DTYPES, RMSNorm, RMSNormKernel

logger = logging.getLogger(__name__)

NORM_KERNELS_ENV = "LORAPLANE_NORM_KERNELS"
CHOICES = ("auto", "torch")
SOURCE = Path(__file__).with_name("rms_norm_cpu.cpp")


@functools.cache
def load_cpu_norm() -> RMSNormKernel | None:
    """The compiled CPU ops, or None (logged once) when they cannot be built here."""
    if not build_cpu_extension("rms_norm", SOURCE, "The CPU RMSNorm kernel", "the torch RMSNorm ops", logger):
        return None
    ops: RMSNormKernel = torch.ops.loraplane_norm
    return ops


def select_norm_kernel(device: torch.device, dtype: torch.dtype) -> RMSNormKernel | None:
    """The kernel for a model of `dtype` on `device` under LORAPLANE_NORM_KERNELS; None means the torch ops
    (also for float32, which the kernel does not serve: nothing is compiled for it)."""
    choice = env_choice(NORM_KERNELS_ENV, CHOICES)
    if choice == "torch" or device.type != "cpu" or dtype not in KERNEL_DTYPES:
        return None
    return load_cpu_norm()


def use_norm_kernel(model: nn.Module, kernel: RMSNormKernel | None) -> None:
    """Every RMSNorm of `model` runs through `kernel` where it serves (None: the torch ops)."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel = kernel
