"""What this process verified itself: the sha256 of files, trusted while each file's stat stamp is
unchanged, and, right after a fetch, the verified bytes themselves, which the loader reads instead of
the file.

An adapter fetched by digest is hashed as it arrives (download.py) and published into the cache;
the PEFT loader digests the files it reads, so without this memo every cold load would hash its files
twice within a second (docs/performance.md#artifacts). The memo answers the loader instead, for files
whose size, mtime (ns), inode and device are those recorded right after verification: any write through
the file system changes the mtime, so an edited file is hashed again and, differing, refused. It lives
in memory only: after a restart the first load of a cached version hashes it once more.

Held bytes (`hold`, while the cache's `acquire` that fetched them lasts): the buffer whose every byte
matched the manifest's sha256 in memory, so the first load parses it there (views of the buffer, no
re-read of the cached file, no copy) instead of mapping the file it was just written to. What the
loader gets is exactly what was hashed, whatever happens to the file on disk meanwhile. With the
weights, their stage (download.Stage: the host copy made while they arrived) is held too, for the
first load to adopt (`take_stage`, once: a second load of the same bytes copies them itself); one
nobody adopted is discarded with the held bytes.
Paths are keyed by their real path, as the loader names them.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from data_plane.adapters.artifacts.buffers import Buffer
from data_plane.adapters.artifacts.download import Stage

Stamp = tuple[int, int, int, int]  # size, mtime_ns, inode, device


def _stamp(path: Path) -> Stamp | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev


def _key(path: Path) -> str:
    return os.path.realpath(path)


Known = dict[str, tuple[Stamp, str]]  # real path -> (its stamp when hashed, sha256)


class VerifiedFiles:
    def __init__(self, known: Known | None = None) -> None:
        self._known: Known = dict(known or {})
        self._held: dict[str, tuple[str, Buffer]] = {}  # path -> (sha256, the verified bytes)
        self._stages: dict[str, Stage] = {}  # path -> its held bytes' stage, until adopted
        self._lock = threading.Lock()  # the cache publishes on the loop, loaders ask from reader threads

    def remember(self, path: Path, sha256: str) -> None:
        stamp = _stamp(path)
        if stamp is not None:
            with self._lock:
                self._known[_key(path)] = (stamp, sha256)

    def hold(self, path: Path, sha256: str, contents: Buffer, stage: Stage | None = None) -> None:
        """`contents` are the bytes of `path` whose sha256 was checked in memory (the caller no longer
        writes them), `stage` what was staged from them; answered by `contents_of` and `take_stage` until
        `release_under`."""
        with self._lock:
            self._held[_key(path)] = (sha256, contents)
            replaced = self._stages.pop(_key(path), None)
            if stage is not None:
                self._stages[_key(path)] = stage
        if replaced is not None:
            replaced.discard()

    def release_under(self, folder: Path) -> None:
        """Drop the held bytes of files in `folder` (their file is the copy from now on)."""
        prefix = _key(folder) + os.sep
        with self._lock:
            for key in [k for k in self._held if k.startswith(prefix)]:
                del self._held[key]
            stages = [self._stages.pop(k) for k in [k for k in self._stages if k.startswith(prefix)]]
        for stage in stages:
            stage.discard()

    def forget_under(self, folder: Path) -> None:
        self.release_under(folder)
        prefix = _key(folder) + os.sep
        with self._lock:
            for key in [k for k in self._known if k.startswith(prefix)]:
                del self._known[key]

    def take_stage(self, path: Path) -> Stage | None:
        """The stage of `path`'s held bytes, handed out once (whoever takes it adopts or discards it)."""
        with self._lock:
            return self._stages.pop(_key(path), None)

    def contents_of(self, path: Path) -> tuple[str, Buffer] | None:
        """(sha256, bytes) of `path` as verified in memory, if still held."""
        with self._lock:
            return self._held.get(_key(path))

    def known_under(self, folder: Path) -> Known:
        """What was hashed of the files in `folder`: for a VerifiedFiles in another process (the adapter
        reader) that then hashes no file this one knows unchanged."""
        prefix = _key(folder) + os.sep
        with self._lock:
            return {k: v for k, v in self._known.items() if k.startswith(prefix)}

    def sha256_of(self, path: Path) -> str | None:
        """The recorded sha256 if `path` is the very file verified (same stamp), else None (hash it)."""
        with self._lock:
            known = self._known.get(_key(path))
        if known is None or _stamp(path) != known[0]:
            return None
        return known[1]
