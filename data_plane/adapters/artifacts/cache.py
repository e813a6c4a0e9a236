"""The engine's disk cache of adapter versions fetched by digest: DIR/<digest>/<files>, LRU-bounded.

- A folder appears under its digest only complete: files are fetched and verified in memory
  (fetch.py), written into DIR/.partial/<digest>.<nonce>/ and fsynced, the manifest is written
  beside them as `.manifest.json` (a name no artifact file can have), and the whole folder is renamed
  into place, then the directory fsynced. A crash or a failed fetch leaves only .partial/ debris,
  removed at the next start. That write only serves the next start, so it waits: until the load that
  fetched the version has taken its weights from the held bytes (or WRITE_DELAY_S), then until the
  engine has had no request for WRITE_QUIET_S (at most WRITE_IDLE_WAIT_S); neither wait lasts once
  something waits for the write: shutdown, room for another fetch, a discard, a holder that needs the
  files on disk (`on_disk`). It runs in a low-priority
  thread that rests while the engine is busy (data_plane.background.BackgroundPace). Beside the first
  request of the adapter just loaded, the write would delay that request's first token, even paced: on a
  VM the disk's emulation takes host CPU (docs/performance.md#artifacts). A crash before it ends only
  means the next start fetches it again.
- A digest in the cache is never fetched again, also after a restart (the folders are scanned at open).
  Reuse is checked cheaply, the files present with their manifest sizes, and not re-hashed here: the
  load hashes them anyway (the PEFT loader digests what it reads and the registry refuses another
  digest) unless this process verified them itself and their stat stamps are unchanged since. A folder whose files
  changed since is dropped by `discard` when that load check fails, and fetched again.
- Files this process fetched and verified are remembered with their stat stamps (`verified`), so a
  later load does not hash them a second time, and their verified bytes are held until the cache's
  copy is written, so that the load parses them from memory, never from a file not yet (or just)
  written (verified_files.py).
- Concurrent needs of one digest fetch it once (one lock per digest; the waiters then find it cached).
- `max_bytes` bounds the cache: before a fetch, the least recently used digests are evicted that are
  neither held (a fetch or load in progress: `acquire`) nor in use (`in_use`: the digests the LoRA
  registry serves, pinned or not, whose files it may re-read when its host copy was dropped).
- One engine per cache folder: an flock on DIR/.lock refuses a second process at open (CacheInUseError).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import secrets
import shutil
import stat
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import msgspec

from data_plane.adapters.artifacts.buffers import Buffer
from data_plane.adapters.artifacts.fetch import ArtifactFetcher, ArtifactFetchError, refusal
from data_plane.adapters.artifacts.verified_files import VerifiedFiles
from data_plane.adapters.keyed_lock import KeyedLock
from data_plane.background import fetch_off_loop, read_off_loop
from shared.artifacts import DIGEST_PATTERN, ArtifactManifest, ArtifactRef, manifest_matches
from shared.errors import InvalidRequestError, OverloadedError
from shared.manifest import file_sha256

MANIFEST_NAME = ".manifest.json"
WRITE_DELAY_S = 10.0  # the longest a fetched version's write waits for the load that needed it
WRITE_IDLE_WAIT_S = 30.0  # then the longest it waits for the engine to have no request for WRITE_QUIET_S
WRITE_QUIET_S = 1.0
IDLE_POLL_S = 0.05
WRITE_PIECE_BYTES = 4 << 20  # the cache's copy is written in pieces, resting between them when busy
PARTIAL_DIR = ".partial"
LOCK_NAME = ".lock"
_DIGEST = re.compile(DIGEST_PATTERN)
logger = logging.getLogger(__name__)


class CacheInUseError(InvalidRequestError):
    """The cache folder is another process's (its flock is held): a flag the process cannot start with."""


@dataclass
class ArtifactStats:
    """Counters since the engine started (exported by metrics.py)."""

    hits: int = 0  # needs met from the cache (no request made)
    misses: int = 0  # needs that fetched
    fetches: int = 0  # versions fetched and verified into the cache
    fetch_failures: int = 0
    write_failures: int = 0  # fetched and verified, but the cache's copy could not be written
    fetched_bytes: int = 0  # bytes received, verified or not
    evictions: int = 0


class ArtifactCache:
    def __init__(
        self, root: Path, max_bytes: int, fetcher: ArtifactFetcher, *,
        in_use: Callable[[], Collection[str]] = frozenset, stats: ArtifactStats | None = None,
        remove_on_close: bool = False,  # a temporary folder of this process only
    ) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.fetcher = fetcher
        self.in_use = in_use
        self.stats = stats if stats is not None else ArtifactStats()
        self._remove_on_close = remove_on_close
        self._entries: OrderedDict[str, int] = OrderedDict()  # digest -> bytes, least recently used first
        self._holds: Counter[str] = Counter()
        self._reserved = 0  # bytes of fetches in progress
        self._locks = KeyedLock()
        self._writing: dict[str, asyncio.Task[None]] = {}  # digest -> its fetched bytes being written
        self._loaded: dict[str, asyncio.Event] = {}  # digest just fetched -> set once its load is done
        self._hurry = asyncio.Event()  # something waits for the pending writes: they stop waiting for quiet
        self._lock_file: IO[bytes] | None = None
        self.verified = VerifiedFiles()  # what _fetch hashed, for the loader (not hashed again)

    @property
    def size_bytes(self) -> int:
        return sum(self._entries.values())

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries

    # ---- open / close (blocking: at start and shutdown) ----------------------------------------
    def open(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        lock = (self.root / LOCK_NAME).open("ab")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise CacheInUseError(f"--lora-cache-dir {str(self.root)!r} is in use by another engine process; give "
                                  "each engine a folder of its own") from None
        self._lock_file = lock
        shutil.rmtree(self.root / PARTIAL_DIR, ignore_errors=True)  # what a crash or a failed fetch left
        (self.root / PARTIAL_DIR).mkdir()
        found = []
        for child in self.root.iterdir():
            if _DIGEST.match(child.name) and child.is_dir():
                size = _verified_size(child)
                if size is None:
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    found.append((child.stat().st_mtime, child.name, size))
        for _, digest, size in sorted(found):  # mtime is the last use (touched on every hit)
            self._entries[digest] = size

    def close(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # releases the flock
            self._lock_file = None
        if self._remove_on_close:
            shutil.rmtree(self.root, ignore_errors=True)

    # ---- use -----------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def acquire(self, ref: ArtifactRef) -> AsyncIterator[Path]:
        """The folder of `ref`'s verified version, fetched if not cached; it is not evicted while held.
        Right after a fetch its files may not be written yet (`settle` waits for them); until they are,
        `verified` holds their checked bytes, which is what the loader reads (a second holder too: it
        never waits for the write, which may be waiting for the engine to be quiet)."""
        self.fetcher.check(ref)  # the origin rule holds for cached digests too: the same push, the same answer
        digest = ref.digest
        fetched: asyncio.Event | None = None
        self._holds[digest] += 1
        try:
            async with self._locks(digest):
                if digest in self._writing:  # fetched a moment ago: its verified bytes are held until written
                    self.stats.hits += 1
                    folder = self.root / digest
                elif (hit := self._hit(digest)) is not None:
                    self.stats.hits += 1
                    folder = hit
                else:
                    self.stats.misses += 1
                    folder = await self._fetch(ref)
                    fetched = self._loaded.get(digest)
            yield folder
        finally:
            if fetched is not None:
                fetched.set()  # the holder is done with the held bytes: the cache's copy may be written
            self._holds[digest] -= 1
            if not self._holds[digest]:
                del self._holds[digest]

    async def settle(self) -> None:
        """Wait until every fetched version is written into the cache (or its write failed)."""
        while self._writing:
            await self._written(list(self._writing.values()))

    async def on_disk(self, digest: str) -> None:
        """Wait until a held version's files are in its folder (for a holder that hands the folder to
        another process, which cannot read the held bytes): its write waits neither for the load nor for
        a quiet engine. A failed write leaves no folder; the holder finds its files missing."""
        writing = self._writing.get(digest)
        if writing is not None:
            await self._written([writing])

    def check_files(self, digest: str) -> ArtifactManifest:
        """Blocking: the manifest of a held version once every file in its folder is a regular file with
        the listed size and sha256 (a file this process verified, its stat stamp unchanged, is not hashed
        again); `checksum_mismatch` (400) otherwise. For a holder whose reader does not check what it reads
        (another process: `loraplane agent`'s engine); on a refusal, `discard` and acquire again."""
        folder = self.root / digest
        try:
            manifest = msgspec.json.decode((folder / MANIFEST_NAME).read_bytes(), type=ArtifactManifest)
        except (OSError, msgspec.ValidationError, msgspec.DecodeError):
            raise refusal(f"the cached copy of {digest[:16]}… has no valid manifest", "checksum_mismatch") from None
        if manifest.digest != digest or not manifest_matches(manifest):
            raise refusal(f"the cached copy of {digest[:16]}… is another version", "checksum_mismatch")
        for f in manifest.files:
            path = folder / f.name
            try:
                st = path.lstat()
                same = stat.S_ISREG(st.st_mode) and st.st_size == f.size and (
                    self.verified.sha256_of(path) == f.sha256 or file_sha256(path) == f.sha256)
            except OSError:
                same = False
            if not same:
                raise refusal(f"checksum mismatch for {f.name}: the cached copy changed since it was verified",
                              "checksum_mismatch")
        return manifest

    async def discard(self, digest: str) -> None:
        """Drop a cached version whose files no longer hash to its digest (the next need fetches it)."""
        writing = self._writing.get(digest)
        if writing is not None:
            await self._written([writing])
        if digest in self._entries:
            del self._entries[digest]
            await self._remove(self.root / digest)

    def _hit(self, digest: str) -> Path | None:
        if digest not in self._entries:
            return None
        folder = self.root / digest
        if _verified_size(folder) is None:  # files removed or truncated behind the engine's back
            del self._entries[digest]
            shutil.rmtree(folder, ignore_errors=True)
            return None
        self._entries.move_to_end(digest)
        with contextlib.suppress(OSError):
            os.utime(folder)  # the LRU order survives a restart
        return folder

    async def _fetch(self, ref: ArtifactRef) -> Path:
        """Fetch and verify in memory; the bytes are held for the loader and written into the cache in
        the background, so that the load does not wait for the files to reach the disk first."""
        manifest = await self.fetcher.manifest(ref)
        size = manifest.size_bytes
        await self._make_room(size)
        self._reserved += size
        try:
            received = await self.fetcher.receive(manifest)
        except BaseException:
            self.stats.fetch_failures += 1
            self._reserved -= size
            raise
        self.stats.fetches += 1
        folder = self.root / ref.digest
        for f in manifest.files:
            self.verified.hold(folder / f.name, f.sha256, received[f.name].data, received[f.name].stage)
        contents = {name: r.data for name, r in received.items()}
        # named here; `_write` makes it at once, so its appearance is when the version was verified
        partial = self.root / PARTIAL_DIR / f"{ref.digest}.{secrets.token_hex(4)}"
        loaded = self._loaded[ref.digest] = asyncio.Event()
        self._writing[ref.digest] = asyncio.ensure_future(self._write(partial, manifest, contents, loaded))
        return folder

    async def _write(self, partial: Path, manifest: ArtifactManifest, contents: dict[str, Buffer],
                     loaded: asyncio.Event) -> None:
        """The verified version into the cache, once `loaded` (the load took its weights) and the engine
        is idle, or later waits run out (module docstring); a failure is logged, and the next need
        fetches it again."""
        digest, size = manifest.digest, manifest.size_bytes
        try:
            # at once: its appearance is when the version was verified (bench/artifacts.py times by it)
            partial.mkdir()
            await _first_of(loaded, self._hurry, WRITE_DELAY_S)
            await self._quiet_engine()
            folder = await fetch_off_loop(self._publish, partial, manifest, contents)
        except Exception as exc:
            self.stats.write_failures += 1
            self.verified.forget_under(self.root / digest)
            shutil.rmtree(partial, ignore_errors=True)
            logger.warning("adapter %s… was fetched and verified but not cached: %s", digest[:16], exc)
        else:
            self._entries[digest] = size
            for f in manifest.files:
                self.verified.remember(folder / f.name, f.sha256)
            self.verified.release_under(folder)  # the file is the copy from now on
        finally:
            self._reserved -= size
            del self._writing[digest]
            self._loaded.pop(digest, None)
            if not self._writing:
                self._hurry.clear()

    async def _written(self, writes: list[asyncio.Task[None]]) -> None:
        """Wait for these writes; pending writes stop waiting for a quiet engine, since something waits."""
        self._hurry.set()
        await asyncio.wait([asyncio.shield(w) for w in writes])

    async def _quiet_engine(self) -> None:
        """Until the engine has had no request for WRITE_QUIET_S (the first requests of an adapter just
        loaded come right after its load), WRITE_IDLE_WAIT_S have passed, or something waits for the
        writes (`_written`)."""
        give_up = time.monotonic() + WRITE_IDLE_WAIT_S
        quiet_since = time.monotonic()
        while time.monotonic() < give_up and not self._hurry.is_set():
            if self.fetcher.pace.busy():
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= WRITE_QUIET_S:
                return
            await asyncio.sleep(IDLE_POLL_S)

    def _publish(self, partial: Path, manifest: ArtifactManifest, contents: dict[str, Buffer]) -> Path:
        """Blocking: the verified files and their manifest written and fsynced, then the whole folder
        renamed into place, durably. A local disk error (full, read-only) is worth a retry later."""
        try:
            for name, data in (*contents.items(), (MANIFEST_NAME, msgspec.json.encode(manifest))):
                with (partial / name).open("xb", buffering=0) as fh:
                    self._write_paced(fh, memoryview(data))
                    os.fsync(fh.fileno())  # the file's metadata (the data is on the disk already)
            _fsync_dir(partial)
            folder = self.root / manifest.digest
            shutil.rmtree(folder, ignore_errors=True)  # an invalid leftover _hit found
            partial.rename(folder)
            _fsync_dir(self.root)
        except OSError as exc:
            raise ArtifactFetchError(f"cannot write adapter {manifest.digest[:16]}… into the LoRA cache "
                                     f"({exc.strerror or exc})", param="artifact") from None
        return folder

    def _write_paced(self, fh: IO[bytes], data: memoryview) -> None:
        """All of `data` into `fh`, durably, in pieces: each copied into the page cache (the GIL
        released) and flushed to the disk at once, so that the disk's work is spread out too, not one
        burst at a final fsync (on a VM its emulation takes host CPU from the engine); between pieces
        the thread rests while the engine is busy, for the piece's whole time, waits on the disk
        included."""
        written = 0
        while written < len(data):
            started = time.perf_counter()
            written += fh.write(data[written:written + WRITE_PIECE_BYTES]) or 0
            os.fdatasync(fh.fileno())
            self.fetcher.pace.rest(time.perf_counter() - started)

    async def _make_room(self, size: int) -> None:
        busy = set(self.in_use()) | set(self._holds) | set(self._writing)
        while self.size_bytes + self._reserved + size > self.max_bytes:
            victim = next((d for d in self._entries if d not in busy), None)
            if victim is None and self._writing:  # versions being written count as reserved: once
                await self._written(list(self._writing.values()))  # written they may be evictable
                busy = set(self.in_use()) | set(self._holds) | set(self._writing)
                continue
            if victim is None:
                raise OverloadedError(
                    f"the LoRA cache cannot take {size} more bytes: {self.size_bytes + self._reserved} of "
                    f"--lora-cache-max-bytes {self.max_bytes} are adapters in use or being fetched; unload "
                    "some or raise the limit", param="artifact", code="lora_cache_full")
            del self._entries[victim]
            self.stats.evictions += 1
            await self._remove(self.root / victim)

    async def _remove(self, folder: Path) -> None:
        self.verified.forget_under(folder)
        # renamed away first (instant), so the digest's folder is gone even if the removal is interrupted
        trash = self.root / PARTIAL_DIR / f"{folder.name}.evicted.{secrets.token_hex(4)}"
        try:
            folder.rename(trash)
        except OSError:
            return
        await read_off_loop(shutil.rmtree, trash, True)


def _verified_size(folder: Path) -> int | None:
    """The version's size if `folder` holds its manifest and every listed file with the listed size."""
    try:
        manifest = msgspec.json.decode((folder / MANIFEST_NAME).read_bytes(), type=ArtifactManifest)
        if manifest.digest != folder.name or not manifest_matches(manifest):
            return None
        for f in manifest.files:
            st = (folder / f.name).lstat()  # a symlink is not a cached file: it could lead anywhere
            if not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
                return None
    except (OSError, msgspec.ValidationError, msgspec.DecodeError):
        return None
    return manifest.size_bytes


async def _first_of(a: asyncio.Event, b: asyncio.Event, timeout_s: float) -> None:
    """Until either event is set, or `timeout_s` passed."""
    waits = [asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait())]
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
