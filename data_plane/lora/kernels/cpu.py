"""The CPU decode kernels (bgmv_cpu.cpp), compiled on first use with torch's cpp_extension.

The wheel ships the C++ source only, so it stays torch-free and pip never builds against a downloaded
torch: the engine compiles it here against the torch it runs with, once, into a cache folder
(LORAPLANE_KERNEL_BUILD_DIR, default .loraplane/build under the working directory; torch's ninja build
recompiles only when the source, flags or torch change). Without a compiler or ninja, or when the
build fails, `load_cpu_kernels` answers None once with a warning and the pure-torch ops serve.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path

import torch

from data_plane.lora.ops import Lanes, TorchKernels

logger = logging.getLogger(__name__)

BUILD_DIR_ENV = "LORAPLANE_KERNEL_BUILD_DIR"
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


def build_dir() -> Path:
    return Path(os.environ.get(BUILD_DIR_ENV) or Path.cwd() / ".loraplane" / "build").absolute()


def _cflags() -> tuple[str, list[str]]:
    """A name suffix and flags for this CPU: the build is cached per instruction set, so one folder
    shared by machines of another kind never loads code they cannot run."""
    capability = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
    flags = ["-O3", "-fopenmp"]  # OpenMP: at::parallel_for's pragmas; libgomp is the one torch loaded
    if capability.startswith("AVX"):
        flags += ["-mavx2", "-mfma"] + (["-mavx512f", "-mavx512bw", "-mavx512vl"] if capability == "AVX512" else [])
    return capability.lower(), flags


@functools.cache
def load_cpu_kernels() -> CPUKernels | None:
    """The compiled kernels, or None (logged once) when they cannot be built here."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    missing = [name for name, found in ((compiler, shutil.which(compiler)), ("ninja", cpp_extension.is_ninja_available()))
               if not found]
    if missing:
        logger.warning("LoRA CPU kernels unavailable (no %s found): using the pure-torch LoRA ops", " or ".join(missing))
        return None

    suffix, flags = _cflags()
    folder = build_dir() / f"lora_bgmv_{suffix}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name=f"loraplane_lora_bgmv_{suffix}", sources=[str(SOURCE)], extra_cflags=flags,
                           extra_ldflags=["-fopenmp"], build_directory=str(folder), is_python_module=False,
                           verbose=False)
    except Exception as exc:  # a compiler error, a missing header, a read-only folder: the torch ops serve
        logger.warning("LoRA CPU kernels failed to build in %s (%s): using the pure-torch LoRA ops", folder, exc)
        return None
    logger.info("LoRA CPU kernels loaded from %s", folder)
    return CPUKernels()

