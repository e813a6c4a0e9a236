"""Adapter files read and checked in a process of their own, off the API process's GIL.

A load reads and validates a few hundred tensors: Python between torch ops, on a thread of the API
process, holding the GIL one slice at a time. Meanwhile the event loop, which hands every stream its
next token, waits for the GIL at each wake-up, while the core's own steps stay near steady (why: see
docs/performance.md#hot-loads; measure with bench/hot_load.py). So the reading runs in an adapter reader
process: `python -m data_plane.adapters.loading.reader_process_main`, started by the
first load and a second when two loads meet running requests (until one is ready, a load reads on its own
thread), at lower priority (data_plane.background.READER_NICENESS), with one torch thread and the API's
environment minus its secrets (shared.secret_env.without_secrets: it calls nobody). It writes the
adapter's host copy into a shared-memory file named for the API process (shared_tensors.py), and answers
with its layout only (transfer.SharedAdapter, a few KB); the API process maps the file and owns it from
then on (transfer.adopt_adapter), exactly as if it had read it itself. Up to WORKERS loads run at once,
one per reader process.
A load that meets running requests while every ready reader is busy waits for one (at most BUSY_WAIT_S)
instead of reading on its own thread: a paced read is short, and a burst of loads read on the API's
threads would slow the streams as much as having no readers.
While the engine has requests, a reader rests between small pieces of its work, so that it takes at most
data_plane.background.READER_BUSY_CPU_SHARE of a CPU and never a core's whole step from the engine
(CpuPace).

A version the engine just fetched is still held in this process's memory (artifacts/verified_files.py): such a
load stays on the calling thread, reading from those bytes. A reader that dies mid-load (killed, out
of memory) fails that load with an error that says so; a later load starts a new one.

    API reader thread ──(reading, path, hashes)──▶ reader process ──▶ /dev/shm/loraplane-adapter-<API pid>-…
                      ◀── SharedAdapter (layout) or the loader's error ──────┘
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

from data_plane.adapters.artifacts.verified_files import Known, VerifiedFiles
from data_plane.adapters.loading.peft_loader import held_files
from data_plane.adapters.loading.spec import AdapterReading
from data_plane.adapters.loading.transfer import SharedAdapter, adopt_adapter
from data_plane.lora.errors import LoRAAdapterError
from data_plane.lora.weights import LoRAAdapterWeights
from shared.secret_env import without_secrets

logger = logging.getLogger(__name__)
READER_MODULE = "data_plane.adapters.loading.reader_process_main"  # how a reader shows in a process list
WORKERS = 2  # as many loads at once as the reader threads (data_plane/background.py) run
MAX_START_FAILURES = 3  # readers that exit while starting before loads stop starting them (they read here)
# how long a load that meets running requests waits for a busy reader before reading on its own thread:
# several paced reads' time, so a burst of loads on two readers all find one (docs/performance.md#hot-loads)
BUSY_WAIT_S = 2.0


class AdapterReaderProcess:
    """A Loader (registry.Loader): path -> validated weights, read in a reader process when one is free
    (while the engine has requests, when a busy one frees), else on the calling thread (as
    --no-adapter-reader-process reads).

    Readers are there for loads that meet running requests, so they start on demand: the first load starts
    one beside it (it imports torch, at its low priority), so that it is ready when traffic comes: started
    by the first load that met traffic, it would import torch for many times as long on CPUs the engine
    keeps busy, and every load meanwhile would read here (docs/performance.md#hot-loads); more start, up
    to `workers`, when loads that meet running requests (`busy()`) find none free. Loads never wait for a
    reader to start: until one is ready they read here. An engine that never loads an adapter from files
    never starts one."""

    def __init__(self, reading: AdapterReading, verified: VerifiedFiles | None = None,
                 workers: int = WORKERS, busy: Callable[[], bool] = lambda: True) -> None:
        self.reading = reading  # each request carries it: the reader reads exactly as this process would
        self.verified = verified
        self.workers = workers
        self.busy = busy
        self._changed = threading.Condition()  # guards what follows; notified when a reader frees or fails
        self._readers: set[_Reader] = set()  # started, ready or not
        self._free: list[_Reader] = []  # ready and not reading, the most recently used last (warm)
        self._starting: set[_Reader] = set()  # not ready yet: a start thread reads their socket
        self._start_failures = 0
        self._closed = False
        # loads by (where they were read, whether the engine had requests): /metrics (reader_process_metrics.py)
        self.reads: Counter[tuple[str, bool]] = Counter()

    def __call__(self, path: str) -> LoRAAdapterWeights:
        folder = _real(path)
        reader, busy = None, self.busy()
        if folder is None or held_files(folder, self.verified) is None:
            # (bytes this process holds are read here, from them: nothing to copy across)
            reader = self._take(busy)
        with self._changed:  # (loads run on several threads)
            self.reads[("reader_process" if reader is not None else "api_thread", busy)] += 1
        if reader is None:
            return self.reading.read(path, self.verified)
        known = self.verified.known_under(folder) if self.verified is not None and folder is not None else {}
        try:
            outcome = reader.ask(self.reading, path, known, busy)
        except (EOFError, OSError) as exc:  # its end of the socket closed: the process is gone
            self._drop(reader)
            code = reader.process.wait()
            logger.error("adapter reader %d died reading %s (exit %s)", reader.process.pid, path, code)
            raise LoRAAdapterError(
                f"the adapter reader process died while reading this adapter (exit code {code}); the "
                "engine serves on: check the files, or the host's memory, and load it again") from exc
        except Exception:  # an answer that cannot be unpickled here: the reader itself is fine
            self._release(reader)
            raise
        self._release(reader)
        if isinstance(outcome, BaseException):
            raise outcome
        return adopt_adapter(outcome)

    def start(self, import_first: bool = False) -> None:
        """Start a reader now if none runs (a warm reader for the next load). `import_first`: it imports torch
        at the calling thread's priority and only then lowers its own (an engine starting up, which serves
        nothing yet: ready sooner than once traffic keeps the CPUs busy)."""
        with self._changed:
            if not self._readers and not self._closed:
                self._start_reader(import_first)

    def wait_ready(self, timeout: float) -> bool:
        """Whether a reader is free for a load within `timeout` seconds (False at once if none is starting)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._free or not self._readers or self._closed, timeout) \
                and bool(self._free)

    def close(self) -> None:
        """Stop the reader processes (server shutdown); a load after this fails. A reader free ends when its
        socket closes, one starting is killed (its start thread sees the end), and one reading ends once it
        has answered (`_release`): nobody closes a socket that another thread is reading."""
        with self._changed:
            self._closed = True
            free, starting = self._free, self._starting & self._readers
            self._readers, self._free = set(), []
            self._changed.notify_all()
        for reader in free:
            reader.stop()
        for reader in starting:
            _kill(reader.process)

    def states(self) -> dict[str, int]:
        """How many readers are starting, idle (ready and free) and reading a load."""
        with self._changed:
            starting, idle = len(self._starting & self._readers), len(self._free)
            return {"starting": starting, "idle": idle, "reading": len(self._readers) - starting - idle}

    def pids(self) -> list[int]:
        with self._changed:
            return [r.process.pid for r in self._readers]

    def _take(self, busy: bool) -> _Reader | None:
        """The most recently used reader free, if any (warm). When none is free, one more starts for the loads
        after this one: the first whatever the engine does, more (up to `workers`) while it has requests
        (`busy`). And while it has requests and a reader that is ready reads another load, this one waits for
        a reader to free (at most BUSY_WAIT_S) instead of reading here, on the API process's GIL, which
        would stall the streams (docs/performance.md#hot-loads). None: read here (the engine is idle, no
        reader is ready yet, or the wait ran out)."""
        dead: list[_Reader] = []
        deadline = time.monotonic() + BUSY_WAIT_S
        try:
            with self._changed:
                while True:
                    if self._closed:
                        raise _shutting_down()
                    reader = self._pop_free(dead)
                    if reader is not None:
                        return reader
                    wanted = self.workers if busy else 1
                    if len(self._readers) < wanted and self._start_failures < MAX_START_FAILURES:
                        self._start_reader()
                    reading = self._readers - self._starting  # ready, each busy with a load
                    remaining = deadline - time.monotonic()
                    if not (busy and reading) or remaining <= 0:
                        return None
                    self._changed.wait(remaining)  # notified when a reader frees, fails or the pool closes
        finally:
            for reader in dead:
                reader.stop()

    def _pop_free(self, dead: list[_Reader]) -> _Reader | None:
        """(holding the lock) The most recently used free reader still alive; the dead ones go to `dead`."""
        while self._free:
            reader = self._free.pop()
            if reader.process.poll() is None:
                return reader
            logger.warning("adapter reader %d exited while idle (%s)", reader.process.pid, reader.process.returncode)
            self._readers.discard(reader)
            dead.append(reader)
        return None

    def _start_reader(self, import_first: bool = False) -> None:
        """(holding the lock) A new reader, free once it says it is ready."""
        reader = _Reader.start(import_first)
        self._readers.add(reader)
        self._starting.add(reader)
        threading.Thread(target=self._await_ready, args=(reader,), name="adapter-reader-start", daemon=True).start()

    def _await_ready(self, reader: _Reader) -> None:
        try:
            reader.conn.recv()  # its "ready", once it has imported what reading needs
        except (EOFError, OSError):
            with self._changed:
                self._starting.discard(reader)
                failed = reader in self._readers  # else killed by close: no failure
                self._readers.discard(reader)
                self._start_failures += failed
                given_up = self._start_failures >= MAX_START_FAILURES
                self._changed.notify_all()  # wait_ready: one fewer starting
            reader.stop()
            if failed:
                logger.error("adapter reader %d exited while starting (exit %s)%s", reader.process.pid,
                             reader.process.wait(), "; adapters are read on threads of this process from now on"
                             if given_up else "")
            return
        with self._changed:
            self._starting.discard(reader)
        self._release(reader)

    def _release(self, reader: _Reader) -> None:
        with self._changed:
            kept = reader in self._readers  # not dropped nor closed meanwhile
            if kept:
                self._free.append(reader)
                self._changed.notify_all()  # wait_ready
        if not kept:
            reader.stop()

    def _drop(self, reader: _Reader) -> None:
        with self._changed:
            self._readers.discard(reader)
            self._changed.notify_all()
        reader.stop()


def _shutting_down() -> LoRAAdapterError:
    return LoRAAdapterError("the engine is shutting down; load the adapter on another engine")


def _real(path: str) -> Path | None:
    try:
        return Path(os.path.realpath(path))
    except (ValueError, OSError):  # a NUL byte, a loop: the reader refuses it in the loader's words
        return None


class _Reader:
    """One reader process and this side's end of its socket (multiprocessing's framing, pickled messages)."""

    def __init__(self, process: subprocess.Popen[bytes], conn: Connection) -> None:
        self.process = process
        self.conn = conn

    @classmethod
    def start(cls, import_first: bool = False) -> _Reader:
        ours, theirs = socket.socketpair()
        with theirs:
            process = subprocess.Popen([sys.executable, "-m", READER_MODULE, str(theirs.fileno()),
                                        *(["--import-first"] if import_first else [])],
                                       pass_fds=[theirs.fileno()], env=without_secrets(os.environ),
                                       stdin=subprocess.DEVNULL)
        atexit.register(_kill, process)  # however the API process ends, its readers go with it
        logger.info("adapter reader: process %d", process.pid)
        return cls(process, Connection(ours.detach()))

    def ask(self, reading: AdapterReading, path: str, known: Known, busy: bool) -> SharedAdapter | BaseException:
        """The reader's answer for `path`: a SharedAdapter, or the exception the loader raised. `busy`: the
        engine has requests, so the reader paces its CPU (background.CpuPace)."""
        self.conn.send((reading, path, known, busy))
        answer: SharedAdapter | BaseException = self.conn.recv()  # what reader_process_main sends
        return answer

    def stop(self) -> None:
        self.conn.close()  # the reader's next receive ends it
        try:
            self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            _kill(self.process)


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()
