"""One artifact file downloaded, hashed and written in a single low-priority thread (blocking code).

Why not the API's event loop (httpx, as the manifest is fetched): httpx hands a download to Python in
64 KiB pieces, each parsed and copied while holding the GIL, on the thread that also serves requests.
That ran at about 250 MB/s here and took the GIL from the engine's step thread thousands of times per
adapter. Here the stdlib HTTP client reads the body straight into one 1 MiB buffer (`readinto`: the
socket copies into it without the GIL), and the sha256 update and the file write of that buffer release
the GIL too: about 200 Python-level turns for a 200 MB file, on a thread whose nice value gives the
engine's forward pass the CPU first (data_plane.lora.reader).

The rules are those of artifact_fetch: the caller has checked the URL's origin; redirects are answers,
never followed (http.client does not follow them); `headers` carry the token only when the URL is the
control plane's; more bytes than listed, fewer, or another sha256 refuse the load.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from data_plane.lora.errors import LoRAAdapterError
from shared.artifacts import ArtifactFile
from shared.errors import LoraplaneError

BUFFER_BYTES = 1 << 20
T = TypeVar("T")


@dataclass(frozen=True)
class Download:
    url: str  # absolute, origin already checked
    headers: dict[str, str]
    file: ArtifactFile  # name, size and sha256 the bytes must have
    path: Path  # created here (exclusively); the caller removes it on failure
    where: str  # "file adapter_model.safetensors at '…'" for messages
    read_timeout_s: float  # connect, or one read
    deadline: float  # time.monotonic() by which the whole version must be in


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
    return LoRAAdapterError(str(problem), param="artifact", code=problem.kind)


def mismatch(f: ArtifactFile, detail: str) -> DownloadProblem:
    return DownloadProblem("checksum_mismatch", f"checksum mismatch for {f.name}: {detail}; nothing was loaded")


def download(job: Download, cancelled: threading.Event, on_bytes: Callable[[int], None] | None) -> None:
    """Blocking: GET `job.url` into `job.path`, verified against `job.file` and fsynced."""
    conn = _connection(job.url, job.read_timeout_s)
    try:
        parts = urlsplit(job.url)
        conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                     headers={**job.headers, "Accept-Encoding": "identity"})
        response = conn.getresponse()
        problem = status_problem(response.status, job.where)
        if problem is not None:
            raise problem
        _receive(job, response, cancelled, on_bytes)
    except (OSError, http.client.HTTPException) as exc:  # refused, reset, a read timeout, a broken body
        raise DownloadProblem("retry", f"{job.where}: {type(exc).__name__}") from None
    finally:
        conn.close()


def _receive(job: Download, response: http.client.HTTPResponse, cancelled: threading.Event,
             on_bytes: Callable[[int], None] | None) -> None:
    f = job.file
    buffer = memoryview(bytearray(BUFFER_BYTES))
    with _Sink(job.path) as sink:
        while True:
            if cancelled.is_set() or time.monotonic() > job.deadline:
                raise DownloadProblem("timeout", f"{job.where} was not fetched in time")
            n = response.readinto(buffer)
            if not n:
                if response.length:  # Content-Length not reached: the connection broke off (http.client
                    # answers 0 then, not IncompleteRead)
                    raise DownloadProblem("retry", f"{job.where}: the body broke off after {sink.size} bytes")
                break
            if sink.size + n > f.size:
                raise mismatch(f, f"more than the {f.size} bytes listed")
            sink.write(buffer[:n])
            if on_bytes is not None:
                on_bytes(n)
        if sink.size != f.size:
            raise mismatch(f, f"{sink.size} bytes received, {f.size} listed")
        if sink.hexdigest() != f.sha256:
            raise mismatch(f, f"sha256 {sink.hexdigest()[:16]}… received, {f.sha256[:16]}… listed")
        sink.finish()


class _Sink:
    """The file being written and hashed; a local disk error (full, read-only) is worth a retry later."""

    def __init__(self, path: Path) -> None:
        self.name = path.name
        self._fh = self._disk(lambda: path.open("xb"))
        self._hash = hashlib.sha256()
        self.size = 0

    def _disk(self, op: Callable[[], T]) -> T:
        try:
            return op()
        except OSError as exc:
            raise DownloadProblem("disk", f"cannot write {self.name} into the LoRA cache "
                                          f"({exc.strerror or exc})") from None

    def write(self, data: memoryview) -> None:
        self._hash.update(data)  # hashlib and the write release the GIL for buffers this large
        self._disk(lambda: self._fh.write(data))
        self.size += len(data)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def finish(self) -> None:
        self._disk(self._fh.flush)
        self._disk(lambda: os.fsync(self._fh.fileno()))

    def __enter__(self) -> _Sink:
        return self

    def __exit__(self, *_: object) -> None:
        self._fh.close()


def _connection(url: str, timeout_s: float) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    if parts.scheme == "https":
        return http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=timeout_s,
                                           context=ssl.create_default_context())
    return http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout_s)
