"""Spool: one incoming version's files on local disk, hashed as they are written, then validated.

Every way in (a folder under the adapter roots, an object-store prefix, an upload) copies the PEFT files
into a fresh folder of this process's spool root first (`<data dir>/spool/p<pid>/`, `spool_root`), counting bytes against `--max-artifact-bytes` and hashing each file
as it lands. Validation (control_plane/artifacts/inspect.py) and the store's copy then read that
private copy, so what is recorded is exactly what was checked, even if the source changes meanwhile,
and nothing ever holds a whole upload in memory. The folder is removed when the spool closes; what a
killed process left is removed when the next one starts (`clean_spools`: every process folder whose
process is gone).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from control_plane.artifacts.inspect import InspectedAdapter, inspect_adapter
from shared.artifacts import is_file_name
from shared.errors import InvalidRequestError, PayloadTooLargeError
from shared.manifest import ManifestEntry, manifest_digest
from shared.peft import CONFIG_NAME, WEIGHTS_NAME

# What a version is made of: the files the manifest digest covers (shared.manifest), nothing else.
VERSION_FILES = (CONFIG_NAME, WEIGHTS_NAME)
_CHUNK = 1 << 20
SPOOL_FOLDER = "spool"
logger = logging.getLogger(__name__)


def spool_root(data_dir: str | None) -> Path:
    """This process's spool folder under the control plane's data folder."""
    assert data_dir is not None, "ControlPlaneSettings sets data_dir"
    return Path(data_dir) / SPOOL_FOLDER / f"p{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def clean_spools(data_dir: str) -> int:
    """Remove what earlier processes left in the spool (a process killed mid-upload): every process folder
    but those of processes still running (another replica on this data folder); returns how many went."""
    removed = 0
    parent = Path(data_dir) / SPOOL_FOLDER
    for folder in parent.glob("p*") if parent.is_dir() else ():
        pid = folder.name[1:]
        if pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid))):
            shutil.rmtree(folder, ignore_errors=True)
            removed += 1
    if removed:
        logger.info("spool: removed %d folder(s) that stopped processes left in %s", removed, parent)
    return removed


@dataclass(frozen=True)
class SpooledFile:
    name: str
    path: Path
    size: int
    sha256: str


class Spool:
    def __init__(self, limit_bytes: int, root: Path, param: str = "lora_path") -> None:
        self.limit_bytes = limit_bytes
        self.param = param  # the request field errors name
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.folder = Path(tempfile.mkdtemp(prefix="spool-", dir=root))
        self.files: dict[str, SpooledFile] = {}

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def writer(self, name: str) -> _Writer:
        """A new file of the version: write chunks, then `finish()` (or use it as a context manager)."""
        if name not in VERSION_FILES:
            allowed = " and ".join(VERSION_FILES)
            raise InvalidRequestError(f"unexpected file {name[:64]!r}: a version is {allowed}", param=self.param)
        if not is_file_name(name) or name in self.files:
            raise InvalidRequestError(f"file {name!r} is given twice", param=self.param)
        return _Writer(self, name)

    def add_reader(self, name: str, source: BinaryIO) -> SpooledFile:
        """Copy an open local file in (blocking I/O: call off the event loop)."""
        with self.writer(name) as writer:
            for chunk in iter(lambda: source.read(_CHUNK), b""):
                writer.write(chunk)
        return self.files[name]

    async def add_stream(self, name: str, chunks: AsyncIterable[bytes]) -> SpooledFile:
        """Write a stream in (an upload part, an object-store download), refusing it past the limit."""
        with self.writer(name) as writer:
            async for chunk in chunks:
                writer.write(chunk)
        return self.files[name]

    def inspect(self) -> InspectedAdapter:
        """Validate the spooled files as a PEFT folder (blocking: call off the event loop). Errors name
        the request's field, not the private folder."""
        missing = [n for n in VERSION_FILES if n not in self.files]
        if missing:
            raise InvalidRequestError(f"{' and '.join(missing)} missing: a version is {' and '.join(VERSION_FILES)}",
                                      param=self.param)
        digest = manifest_digest(ManifestEntry(f.name, f.size, f.sha256) for f in self.files.values())
        return inspect_adapter(str(self.folder), (str(self.folder),), sha256=digest)


class _Writer:
    """One file being spooled: counted against the spool's limit and hashed as it is written; recorded in
    the spool only when the block ends without an error."""

    def __init__(self, spool: Spool, name: str) -> None:
        self.spool, self.name = spool, name
        self.path = spool.folder / name
        self._fh: BinaryIO = self.path.open("wb")
        self._digest = hashlib.sha256()
        self.size = 0

    def __enter__(self) -> _Writer:
        return self

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.spool.total_bytes + self.size > self.spool.limit_bytes:
            raise PayloadTooLargeError(f"the adapter's files exceed --max-artifact-bytes "
                                       f"({self.spool.limit_bytes} bytes)", param=self.spool.param)
        self._digest.update(chunk)
        self._fh.write(chunk)

    def finish(self) -> SpooledFile:
        self._fh.close()
        done = SpooledFile(self.name, self.path, self.size, self._digest.hexdigest())
        self.spool.files[self.name] = done
        return done

    def abort(self) -> None:
        self._fh.close()
        self.path.unlink(missing_ok=True)

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.abort()
