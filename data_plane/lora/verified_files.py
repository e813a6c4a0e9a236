"""The sha256 of files this process verified itself, trusted while each file's stat stamp is unchanged.

An adapter fetched by digest is hashed as it arrives (artifact_download) and published into the cache;
the PEFT loader digests the files it reads, so without this memo every cold load would hash 200 MB twice
within a second (about 0.15 s of a 0.6 s load here). The memo answers the loader instead, for files
whose size, mtime (ns), inode and device are those recorded right after verification: any write through
the file system changes the mtime, so an edited file is hashed again and, differing, refused. It lives
in memory only: after a restart the first load of a cached version hashes it once more.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

Stamp = tuple[int, int, int, int]  # size, mtime_ns, inode, device


def _stamp(path: Path) -> Stamp | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev


class VerifiedFiles:
    def __init__(self) -> None:
        self._known: dict[str, tuple[Stamp, str]] = {}
        self._lock = threading.Lock()  # the cache publishes on the loop, loaders ask from reader threads

    def remember(self, path: Path, sha256: str) -> None:
        stamp = _stamp(path)
        if stamp is not None:
            with self._lock:
                self._known[str(path)] = (stamp, sha256)

    def forget_under(self, folder: Path) -> None:
        prefix = str(folder) + os.sep
        with self._lock:
            for key in [k for k in self._known if k.startswith(prefix)]:
                del self._known[key]

    def sha256_of(self, path: Path) -> str | None:
        """The recorded sha256 if `path` is the very file verified (same stamp), else None (hash it)."""
        with self._lock:
            known = self._known.get(str(path))
        if known is None or _stamp(path) != known[0]:
            return None
        return known[1]
