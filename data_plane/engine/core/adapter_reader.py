"""Adapter files read and checked in a process of their own, off the API process's GIL.

A load reads and validates a few hundred tensors: Python between torch ops, on a thread of the API
process, holding the GIL one slice at a time. Meanwhile the event loop, which hands every stream its
next token, waits for the GIL at each wake-up (bench/hot_load.py: streams' p99 inter-token latency
1.8-2.7x steady while adapters loaded, the core's own steps near steady). So the reading runs in an
adapter reader process: `python -m data_plane.engine.core.adapter_reader_main`, started at the first
load, at lower priority (reader.READER_NICENESS), with one torch thread and the API's environment minus
its secrets (it calls nobody). It writes the adapter's host copy into a shared-memory file named for the
API process (shared_tensors.py), and answers with its layout only (messages.SharedAdapter, a few KB);
the API process maps the file and owns it from then on (adapter_transfer.adopt_adapter), exactly as if
it had read it itself. Up to WORKERS loads run at once, one per reader process.

A version the engine just fetched is still held in this process's memory (verified_files.py): such a
load stays on the calling thread, reading from those bytes. A reader that dies mid-load (killed, out
of memory) fails that load with an error that says so; the next load starts a new one.

    API reader thread ──(path, hashes known)──▶ reader process ──▶ /dev/shm/loraplane-adapter-<API pid>-…
                      ◀── SharedAdapter (layout) or the loader's error ──┘
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

from data_plane.engine.core.adapter_transfer import adopt_adapter
from data_plane.engine.core.process import core_env
from data_plane.lora.adapter_reading import AdapterReading
from data_plane.lora.errors import LoRAAdapterError
from data_plane.lora.verified_files import VerifiedFiles
from data_plane.lora.weights import LoRAAdapterWeights
from shared.peft import CONFIG_NAME, WEIGHTS_NAME

logger = logging.getLogger(__name__)
WORKERS = 2  # as many loads at once as the reader threads (reader.py) run


class AdapterReaderProcess:
    """A Loader (registry.Loader): path -> validated weights, read in a reader process."""

    def __init__(self, reading: AdapterReading, verified: VerifiedFiles | None = None, workers: int = WORKERS) -> None:
        self.reading = reading
        self.verified = verified
        self._idle: queue.LifoQueue[_Reader] = queue.LifoQueue()  # the most recently used first: warm
        self._slots = threading.Semaphore(workers)  # loads at once
        self._lock = threading.Lock()
        self._readers: set[_Reader] = set()
        self._closed = False

    def __call__(self, path: str) -> LoRAAdapterWeights:
        if self._held(path):  # bytes this process holds: reading them here copies nothing across
            return self.reading.read(path, self.verified)
        known = self.verified.known_under(_real(path)) if self.verified is not None else {}
        with self._slots:
            reader = self._take()
            try:
                outcome = reader.ask(path, known)
            except (EOFError, OSError) as exc:  # its end of the socket closed: the process is gone
                self._drop(reader)
                code = reader.process.wait()
                logger.error("adapter reader %d died reading %s (exit %s)", reader.process.pid, path, code)
                raise LoRAAdapterError(
                    f"the adapter reader process died while reading this adapter (exit code {code}); the "
                    "engine serves on: check the files, or the host's memory, and load it again") from exc
            except Exception:  # an answer that cannot be unpickled here: the reader itself is fine
                self._idle.put(reader)
                raise
            self._idle.put(reader)
        if isinstance(outcome, BaseException):
            raise outcome
        return adopt_adapter(outcome)

    def close(self) -> None:
        """Stop the reader processes (server shutdown); a load after this fails."""
        with self._lock:
            self._closed = True
            readers, self._readers = list(self._readers), set()
        for reader in readers:
            reader.stop()

    def pids(self) -> list[int]:
        with self._lock:
            return [r.process.pid for r in self._readers]

    def _held(self, path: str) -> bool:
        if self.verified is None:
            return False
        folder = _real(path)
        return folder is not None and all(self.verified.contents_of(folder / name) is not None
                                          for name in (CONFIG_NAME, WEIGHTS_NAME))

    def _take(self) -> _Reader:
        while True:
            try:
                reader = self._idle.get_nowait()
            except queue.Empty:
                break
            if reader.process.poll() is None:
                return reader
            logger.warning("adapter reader %d exited while idle (%s); starting another",
                           reader.process.pid, reader.process.returncode)
            self._drop(reader)
        with self._lock:
            if self._closed:
                raise LoRAAdapterError("the engine is shutting down; load the adapter on another engine")
            reader = _Reader.start(self.reading)
            self._readers.add(reader)
        return reader

    def _drop(self, reader: _Reader) -> None:
        with self._lock:
            self._readers.discard(reader)
        reader.stop()


def _real(path: str) -> Path | None:
    try:
        return Path(os.path.realpath(path))
    except (ValueError, OSError):  # a NUL byte, a loop: the reader refuses it in the loader's words
        return None


class _Reader:
    """One reader process and this side's end of its socket (multiprocessing's framing, pickled messages)."""

    def __init__(self, process: subprocess.Popen, conn: Connection) -> None:
        self.process = process
        self.conn = conn

    @classmethod
    def start(cls, reading: AdapterReading) -> _Reader:
        ours, theirs = socket.socketpair()
        with theirs:
            process = subprocess.Popen(
                [sys.executable, "-m", "data_plane.engine.core.adapter_reader_main", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], env=core_env(os.environ), stdin=subprocess.DEVNULL)
        atexit.register(_kill, process)  # however the API process ends, its readers go with it
        conn = Connection(ours.detach())
        conn.send(reading)
        logger.info("adapter reader: process %d", process.pid)
        return cls(process, conn)

    def ask(self, path: str, known: dict) -> object:
        """The reader's answer for `path`: a SharedAdapter, or the exception the loader raised."""
        self.conn.send((path, known))
        return self.conn.recv()

    def stop(self) -> None:
        self.conn.close()  # the reader's next receive ends it
        try:
            self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            _kill(self.process)


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()
