"""A file's bytes in memory: the buffer a download fills (`new_buffer`), then verified and handed on."""

from __future__ import annotations

import mmap

# verified bytes in memory: a bytearray, or an anonymous mapping (new_buffer) that a download filled
Buffer = bytearray | mmap.mmap


def new_buffer(size: int) -> Buffer:
    """`size` zero bytes whose pages are not touched yet (an anonymous mapping), for a receive to fill.
    `bytearray(size)` would write every page before the first byte came (docs/performance.md#artifacts)."""
    return mmap.mmap(-1, size) if size >= mmap.PAGESIZE else bytearray(size)
