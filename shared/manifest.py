"""A version's manifest digest: the content identity of an adapter version, defined once.

The manifest of a set of files is one line per file, `name<TAB>size<TAB>sha256-hex`, sorted by name
and joined with newlines (each line ends in `\\n`); its digest is the sha256 of those bytes, in hex.
The control plane records it per version, pushes carry it as `expected_sha256`, engines compute it
from the files they load and refuse a mismatch, and the prefix-cache namespace derives from it.
Torch-free and dependency-free: both halves and the router import it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

_CHUNK = 1 << 20


@dataclass(frozen=True)
class ManifestEntry:
    name: str  # the file's name inside the version (no directories)
    size: int
    sha256: str  # hex


def file_sha256(path: Path, after_chunk: Callable[[], None] | None = None) -> str:
    """`after_chunk`: called after each MiB hashed (a reader that paces its CPU rests there)."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
            if after_chunk is not None:
                after_chunk()
    return digest.hexdigest()


def manifest_bytes(entries: Iterable[ManifestEntry]) -> bytes:
    lines = sorted(entries, key=lambda e: e.name)
    names = [e.name for e in lines]
    if len(set(names)) != len(names):
        raise ValueError("a manifest names each file once")
    for e in lines:
        if not e.name or any(c in e.name for c in "\t\n/\\\0"):
            raise ValueError(f"file name {e.name!r} cannot appear in a manifest")
    return "".join(f"{e.name}\t{e.size}\t{e.sha256}\n" for e in lines).encode()


def manifest_digest(entries: Iterable[ManifestEntry]) -> str:
    return hashlib.sha256(manifest_bytes(entries)).hexdigest()


def entries_of(files: Iterable[Path], after_chunk: Callable[[], None] | None = None) -> list[ManifestEntry]:
    """Hash each file (blocking I/O: call off the event loop)."""
    return [ManifestEntry(f.name, f.stat().st_size, file_sha256(f, after_chunk)) for f in files]


def files_digest(files: Iterable[Path]) -> str:
    """The manifest digest of files on disk, each named by its base name."""
    return manifest_digest(entries_of(files))
