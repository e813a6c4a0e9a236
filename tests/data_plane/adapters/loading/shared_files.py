"""Where an adapter's host copy lies: its shared-memory file's mappings, the files this process owns, and
the same adapter built without one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from data_plane.adapters.loading.shared_tensors import file_prefix, shm_dir
from data_plane.lora.weights import LoRAAdapterWeights, LoRAModuleWeights


def mappings_of(file: str) -> list[tuple[int, int]]:
    """The address ranges at which this process maps `file` (from /proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == file:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def inside(t: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    return any(start <= t.data_ptr() and t.data_ptr() + t.nbytes <= end for start, end in ranges)


def own_shared_files() -> set[Path]:
    """The shared-memory files this process owns now (host copies of the adapters loaded and still held)."""
    pattern = file_prefix(os.getpid()) + "*"
    return set(shm_dir().glob(pattern)) | set(Path(tempfile.gettempdir()).glob(pattern))


def unshared(weights: LoRAAdapterWeights) -> LoRAAdapterWeights:
    """A copy of the adapter built without a shared file (as a test or another loader builds weights)."""
    layers = {index: {name: LoRAModuleWeights(w.lora_a.clone(), w.lora_b.clone(), w.scaling) for name, w in mods.items()}
              for index, mods in weights.layers.items()}
    return LoRAAdapterWeights(weights.path, weights.description, layers)
