"""Compile a C++ kernel source on first use with torch's cpp_extension, into a per-CPU cache folder.

The wheel ships the C++ sources only, so it stays torch-free and pip never builds against a downloaded
torch: the engine compiles them here against the torch it runs with, once, into a cache folder
(LORAPLANE_KERNEL_BUILD_DIR, default .loraplane/build under the working directory; torch's ninja build
recompiles only when the source, flags or torch change). Without a compiler or ninja, or when the build
fails, `build_cpu_extension` answers False with a warning naming what serves instead.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

BUILD_DIR_ENV = "LORAPLANE_KERNEL_BUILD_DIR"


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


def build_cpu_extension(name: str, source: Path, what: str, fallback: str, log: logging.Logger) -> bool:
    """Compile and load `source` (it registers its ops with TORCH_LIBRARY); False, logged, when it cannot.

    what: the kernels' name for the log ("LoRA CPU kernels"); fallback: what serves without them.
    """
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    missing = [tool for tool, found in ((compiler, shutil.which(compiler)), ("ninja", cpp_extension.is_ninja_available()))
               if not found]
    if missing:
        log.warning("%s unavailable (no %s found): using %s", what, " or ".join(missing), fallback)
        return False
    suffix, flags = _cflags()
    folder = build_dir() / f"{name}_{suffix}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name=f"loraplane_{name}_{suffix}", sources=[str(source)], extra_cflags=flags,
                           extra_ldflags=["-fopenmp"], build_directory=str(folder), is_python_module=False,
                           verbose=False)
    except Exception as exc:  # a compiler error, a missing header, a read-only folder: the fallback serves
        log.warning("%s failed to build in %s (%s): using %s", what, folder, exc, fallback)
        return False
    log.info("%s loaded from %s", what, folder)
    return True
