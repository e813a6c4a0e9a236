"""Where an adapter's host tensors lie in one shared-memory file, and who removes that file: SharedLayout.

LoRAAdapterWeights (weights.py) keep their layout, so that handing the adapter to another process sends
only this and the other process maps the file. Files are made, mapped and swept by
data_plane/adapters/loading/shared_tensors.py, whose docstring states their lifetime rule: a file is
removed with the SharedLayout that owns it, unless that layout handed it over.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, NoReturn, TypeVar

import torch

TensorKey = tuple[int, str, str]  # (layer, module short name, "a_t" | "b_t")
K = TypeVar("K")  # a layout's keys: TensorKey for an adapter's host copy, tensor names while staged
K2 = TypeVar("K2")


@dataclass(frozen=True)
class TensorSpan:
    offset: int  # bytes into the file, aligned (shared_tensors.ALIGN)
    shape: tuple[int, ...]


class SharedLayout(Generic[K]):
    """Where tensors lie in one shared file: what a process needs to map them. Owns the file."""

    def __init__(self, file: str, size: int, dtype: torch.dtype, spans: dict[K, TensorSpan]) -> None:
        self.file = file
        self.size = size  # bytes, > 0
        self.dtype = dtype
        self.spans = spans
        self._remove = weakref.finalize(self, _unlink, file)

    def remove(self) -> None:
        """Remove the file now; mappings made before keep their pages."""
        self._remove()

    def rekeyed(self, keys: Mapping[K2, K]) -> SharedLayout[K2]:
        """The same file under other keys (`keys`: new key -> old key), owning it from now on: this
        layout no longer removes it (a stage's tensors, named by the file, adopted by the loader)."""
        if not self._remove.alive:
            raise FileNotFoundError(self.file)
        self._remove.detach()
        return SharedLayout(self.file, self.size, self.dtype, {new: self.spans[old] for new, old in keys.items()})

    def hand_over(self) -> None:
        """From now on this layout does not remove the file: a SharedLayout made of its fields in another
        process owns it (the adapter reader's host copies, adopted by the API process)."""
        self._remove.detach()

    def __reduce__(self) -> NoReturn:
        raise TypeError("a SharedLayout owns its file and is not copied to another process; send its fields")


def _unlink(file: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(file)
