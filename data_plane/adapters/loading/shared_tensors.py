"""An adapter's host copy in one shared-memory file, so that another process maps it instead of copying it.

The PEFT loader writes an adapter's A^T and B^T (the slots' input-major layout) straight into such a
file; handing the adapter to the engine-core process (transfer.py) then sends only
its layout (a few KB on the socket), and the core maps the same pages. Nothing is copied on the API's
event loop, and the host holds the adapter once, not twice.

    file:  [tensor 0 | tensor 1 | …], one dtype, each tensor at a 64-byte aligned offset
    where: /dev/shm, or the temp dir where /dev/shm is missing, read-only or full
    name:  loraplane-adapter-<owner pid>-<random hex>, mode 0600

Lifetime, one rule for every such file: it belongs to the SharedLayout (data_plane/lora/shared_layout.py,
the layout LoRAAdapterWeights hold) that `allocate` returned, in the
process that made it (the API process; the LoRAAdapterWeights holding the layout keeps it alive), or
to the one that process hands it over to (`hand_over`: the adapter reader process makes files for the
API process, named for the API's pid, see `make_files_for`). It
is removed when that object is garbage collected, by `remove()` (a refused load), or at interpreter
exit; a process that maps it (the core) never removes it, and its mapping keeps the pages after the
removal. A process killed outright removes nothing: the next API process to start sweeps the files
whose owner pid is no longer alive (`sweep_orphans`; pids as this PID namespace sees them, so engines
sharing a /dev/shm must share their PID namespace too).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import torch

from data_plane.lora.shared_layout import SharedLayout, TensorSpan

ALIGN = 64
PREFIX = "loraplane-adapter-"
K = TypeVar("K")  # a layout's keys: TensorKey for an adapter's host copy, tensor names while staged


def allocate(shapes: Mapping[K, Sequence[int]], dtype: torch.dtype) -> tuple[dict[K, torch.Tensor], SharedLayout[K]]:
    """A new shared file holding one tensor of `dtype` per entry of `shapes`: (writable views, its layout)."""
    spans, size = {}, 0
    for key, shape in shapes.items():
        spans[key] = TensorSpan(size, tuple(shape))
        size = _aligned(size + math.prod(shape) * dtype.itemsize)
    size = max(size, ALIGN)  # a mapping is never empty
    layout = SharedLayout(_create(size), size, dtype, spans)  # from here the file is removed with `layout`
    try:
        buf = map_file(layout.file, size)
    except BaseException:
        layout.remove()
        raise
    return {key: view(buf, dtype, span) for key, span in spans.items()}, layout


def map_file(file: str, size: int) -> torch.Tensor:
    """The file's first `size` bytes, mapped shared: [size] uint8. FileNotFoundError when it is gone; never
    creates it (torch.from_file(shared=True) would make a new zeroed file, silently serving zeros)."""
    fd = os.open(file, os.O_RDWR)
    try:
        held = os.fstat(fd).st_size
        if held < size:
            raise OSError(f"{file} holds {held} bytes, {size} expected")
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED)
    finally:
        os.close(fd)  # the mapping keeps the file's pages
    return torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive as long as any view of it


def view(buf: torch.Tensor, dtype: torch.dtype, span: TensorSpan) -> torch.Tensor:
    nbytes = math.prod(span.shape) * dtype.itemsize
    return buf[span.offset : span.offset + nbytes].view(dtype).view(span.shape)


_files_for: int | None = None  # the pid named in the files this process makes; None: its own


def make_files_for(owner_pid: int) -> None:
    """Name the files this process makes for `owner_pid`, the process they are handed over to (the API
    process, for its adapter reader): the sweep then keeps them while their real owner lives, and
    removes them once it is gone, whatever became of this process."""
    global _files_for
    _files_for = owner_pid


def file_prefix(owner_pid: int) -> str:
    return f"{PREFIX}{owner_pid}-"


def sweep_orphans() -> list[Path]:
    """Remove the files whose owner process is gone (killed outright, so its finalizers never ran); the
    files of live processes, this one's included, are theirs to remove. Returns what it removed."""
    removed = []
    for directory in {shm_dir(), Path(tempfile.gettempdir())}:
        for path in directory.glob(PREFIX + "*"):
            owner = path.name.removeprefix(PREFIX).partition("-")[0]
            if not owner.isdigit() or _alive(int(owner)):
                continue
            with contextlib.suppress(OSError):  # another user's file, or removed meanwhile
                path.unlink()
                removed.append(path)
    return removed


def _create(size: int) -> str:
    """A new file of `size` bytes, its pages reserved: in /dev/shm, or in the temp dir if it does not fit.
    Reserved (posix_fallocate) rather than sparse: writing a page a full tmpfs cannot hold is a SIGBUS that
    kills the process; here it is ENOSPC, up front (and the copy then takes no page faults: no slower)."""
    error: OSError | None = None
    for directory in dict.fromkeys([shm_dir(), Path(tempfile.gettempdir())]):
        path = directory / f"{file_prefix(_files_for or os.getpid())}{uuid.uuid4().hex}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            error = exc
            continue
        try:
            os.posix_fallocate(fd, 0, size)
            return str(path)
        except OSError as exc:
            error = exc
            path.unlink(missing_ok=True)
        finally:
            os.close(fd)
    assert error is not None
    raise error


def shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
