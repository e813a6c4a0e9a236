"""Which decode attention the paged attention layers run: LORAPLANE_ATTENTION_KERNELS=auto (default) or torch.

auto: on the CPU the compiled kernel (paged_attention_cpu.cpp), which reads each sequence's blocks in
place; everywhere else, and where it cannot be built (said once in the log), the torch path, which
gathers the blocks into a padded copy and runs SDPA. torch: the torch path on every device, e.g. to
compare against it or to rule the kernel out. Prefill attention is torch's SDPA in both cases.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
from torch import nn

from data_plane.device import env_choice
from data_plane.model.attention import DecodeAttentionKernel, PagedAttention
from data_plane.model.cpu_extension import build_cpu_extension

logger = logging.getLogger(__name__)

ATTENTION_KERNELS_ENV = "LORAPLANE_ATTENTION_KERNELS"
CHOICES = ("auto", "torch")
SOURCE = Path(__file__).with_name("paged_attention_cpu.cpp")


@functools.cache
def load_cpu_decode_attention() -> DecodeAttentionKernel | None:
    """The compiled CPU kernel, or None (logged once) when it cannot be built here."""
    if not build_cpu_extension("paged_attention", SOURCE, "The CPU decode attention kernel",
                               "the torch decode attention (gather + SDPA)", logger):
        return None
    return torch.ops.loraplane_attention.paged_decode_attention


def select_decode_attention(device: torch.device) -> DecodeAttentionKernel | None:
    """The kernel for `device` under LORAPLANE_ATTENTION_KERNELS; None means the torch path."""
    choice = env_choice(ATTENTION_KERNELS_ENV, CHOICES)
    if choice == "torch" or device.type != "cpu":
        return None
    return load_cpu_decode_attention()


def use_decode_attention(model: nn.Module, kernel: DecodeAttentionKernel | None) -> None:
    """Every paged attention layer of `model` runs its decode tokens through `kernel` (None: torch)."""
    for module in model.modules():
        if isinstance(module, PagedAttention):
            module.decode_kernel = kernel
