"""One artifact file downloaded and hashed in memory by a single low-priority, paced thread (blocking code).

Why not the API's event loop (httpx, as the manifest is fetched): httpx hands a download to Python in
64 KiB pieces, each parsed and copied while holding the GIL, on the thread that also serves requests:
slow, and it takes the GIL from the engine's step thread thousands of times per adapter
(docs/performance.md#artifacts). Here the stdlib HTTP client reads the body straight into the file's
own buffer, allocated once at its listed size (`readinto` in 1 MiB steps: the socket copies into it
without the GIL), and the sha256 update of each step releases the GIL too. Nothing is written to disk
here: the caller gets the verified bytes, parses them in memory and writes the cache's copy (cache.py),
so a cold load neither waits for a file write inside the receive loop nor reads back the file it has
just written.
The weights file may also be staged (`Download.stage`, a `Stage`: loading/staging.py's TensorStage in the
engine, which copies each tensor into the adapter's host layout on a second thread once its bytes are in,
so that the load has nothing left to copy); the stage is handed on only with bytes whose sha256 matched,
and discarded on any failure. This side defines the interface and never imports the stage (nor torch).

Pacing: the socket's receive buffer is bounded (RECEIVE_BUFFER_BYTES), so the sender (the control
plane, often on the same host) can only send as fast as this thread takes bytes, in windows of at most
that size; and the thread rests between steps while the engine has requests (data_plane.background.
BackgroundPace: at most a quarter of one CPU then, full speed while the engine is idle), so a fetch
neither stalls the forward pass, here or in the process serving it, nor waits for the engine to idle.

The rules are those of fetch.py: the caller has checked the URL's origin; redirects are answers,
never followed (http.client does not follow them); `headers` carry the token only when the URL is the
control plane's; more bytes than listed, fewer, or another sha256 refuse the load.
"""

from __future__ import annotations

import hashlib
import http.client
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

from data_plane.adapters.artifacts.buffers import Buffer, new_buffer
from data_plane.background import BackgroundPace
from shared.artifacts import ArtifactFile
from shared.errors import LoraplaneError
from shared.peft import AdapterFilesError

# one readinto and one hash update (the cancel and deadline checks between them): as large as the receive
# window, so the sender refills the window while this thread hashes (docs/performance.md#artifacts)
STEP_BYTES = 1 << 20
RECEIVE_BUFFER_BYTES = 1 << 20  # SO_RCVBUF: the most the sender can put in flight ahead of this thread


class Stage(Protocol):
    """Work on a file's bytes while they arrive in its buffer (loading/staging.py's TensorStage). The
    receiving thread calls `arrived(n)` once the first n bytes are in, then `finish()` once all are and
    matched their sha256, or `discard()` on any failure; nothing it made may be used before `finish`."""

    def arrived(self, n: int) -> None: ...

    def finish(self) -> None: ...

    def discard(self) -> None: ...


# makes the stage of a file's buffer (allocated at its listed size); its pace says whether the engine is busy
StageFactory = Callable[[Buffer, BackgroundPace], Stage]


@dataclass(frozen=True)
class Download:
    url: str  # absolute, origin already checked
    headers: dict[str, str]
    file: ArtifactFile  # name, size and sha256 the bytes must have
    where: str  # "file adapter_model.safetensors at '…'" for messages
    read_timeout_s: float  # connect, or one read
    deadline: float  # time.monotonic() by which the whole version must be in
    pace: BackgroundPace = field(default_factory=BackgroundPace)  # rests while the engine is busy
    stage: StageFactory | None = None  # work on the bytes as they arrive (the weights' host copy), if any


class DownloadProblem(Exception):
    """Raised in the thread and turned into the caller's error types (they need the event loop's side)."""

    def __init__(self, kind: str, message: str) -> None:  # kind: refusal code, or "retry"
        super().__init__(message)
        self.kind = kind


def status_problem(status: int, where: str) -> DownloadProblem | None:
    """What a non-200 answer means: a redirect or 4xx is final (a refusal), anything else worth a retry."""
    if 300 <= status < 400:
        return DownloadProblem("artifact_redirect", f"{where} answered {status} (redirects are not followed)")
    if 400 <= status < 500:
        return DownloadProblem("artifact_not_available", f"{where} answered {status}")
    if status != 200:
        return DownloadProblem("retry", f"{where} answered {status}")
    return None


RETRYABLE = ("retry", "timeout", "disk")  # the rest are refusal codes: the artifact itself is wrong


def as_error(problem: DownloadProblem, retry: type[LoraplaneError]) -> LoraplaneError:
    if problem.kind in RETRYABLE:
        return retry(str(problem), param="artifact")
    return AdapterFilesError(str(problem), param="artifact", code=problem.kind)


def mismatch(f: ArtifactFile, detail: str) -> DownloadProblem:
    return DownloadProblem("checksum_mismatch", f"checksum mismatch for {f.name}: {detail}; nothing was loaded")


@dataclass
class Received:
    """A file's verified bytes, and for the weights what its stage copied while they arrived."""

    data: Buffer
    stage: Stage | None = None


def download(job: Download, cancelled: threading.Event, on_bytes: Callable[[int], None] | None) -> Received:
    """Blocking: GET `job.url`; its bytes, verified against `job.file` (size and sha256)."""
    conn = _connection(job.url, job.read_timeout_s)
    try:
        conn.connect()
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
        parts = urlsplit(job.url)
        conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                     headers={**job.headers, "Accept-Encoding": "identity"})
        response = conn.getresponse()
        problem = status_problem(response.status, job.where)
        if problem is not None:
            raise problem
        return _receive(job, response, cancelled, on_bytes)
    except (OSError, http.client.HTTPException) as exc:  # refused, reset, a read timeout, a broken body
        raise DownloadProblem("retry", f"{job.where}: {type(exc).__name__}") from None
    finally:
        conn.close()


def _receive(job: Download, response: http.client.HTTPResponse, cancelled: threading.Event,
             on_bytes: Callable[[int], None] | None) -> Received:
    data = new_buffer(job.file.size)  # the manifest's size, bounded by the cache's capacity (fetch.py)
    stage = job.stage(data, job.pace) if job.stage is not None else None
    try:
        _receive_into(job, response, data, stage, cancelled, on_bytes)
    except BaseException:
        if stage is not None:
            stage.discard()  # unverified: nothing it copied may be used
        raise
    if stage is not None:
        stage.finish()  # every byte matched: what it staged may be adopted once it is done
    return Received(data, stage)


def _receive_into(job: Download, response: http.client.HTTPResponse, data: Buffer, stage: Stage | None,
                  cancelled: threading.Event, on_bytes: Callable[[int], None] | None) -> None:
    f = job.file
    view = memoryview(data)
    digest = hashlib.sha256()
    received = 0
    worked = time.thread_time()
    while received < f.size:
        if cancelled.is_set() or time.monotonic() > job.deadline:
            raise DownloadProblem("timeout", f"{job.where} was not fetched in time")
        now = time.thread_time()  # CPU seconds of this thread: waiting for bytes is not work
        job.pace.rest(now - worked)
        worked = time.thread_time()
        n = response.readinto(view[received:received + STEP_BYTES])
        if not n:
            if response.length:  # Content-Length not reached: the connection broke off (http.client
                # answers 0 then, not IncompleteRead)
                raise DownloadProblem("retry", f"{job.where}: the body broke off after {received} bytes")
            raise mismatch(f, f"{received} bytes received, {f.size} listed")
        digest.update(view[received:received + n])  # hashlib releases the GIL for pieces this large
        received += n
        if stage is not None:
            stage.arrived(received)
        if on_bytes is not None:
            on_bytes(n)
    if response.length or response.read(1):  # the body goes on past the listed size
        raise mismatch(f, f"more than the {f.size} bytes listed")
    if digest.hexdigest() != f.sha256:
        raise mismatch(f, f"sha256 {digest.hexdigest()[:16]}… received, {f.sha256[:16]}… listed")


def _connection(url: str, timeout_s: float) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    if parts.scheme == "https":
        return http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=timeout_s,
                                           context=ssl.create_default_context())
    return http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout_s)
