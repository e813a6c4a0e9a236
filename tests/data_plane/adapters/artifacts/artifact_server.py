"""A real HTTP server on loopback that serves adapter artifacts the way the control plane's
`GET /v1/artifacts/{digest}[/{file}]` does (test-only), and counts what it is asked.

It runs in a thread of its own (http.server), so it serves whatever event loop the test runs on. Faults
are set per file: serve other bytes (`corrupt`), or send part of the body and close the connection
(`die_after`). `presign_via` makes the manifest point each file at another server (an object store's
presigned URL) that serves the blob by its sha256.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgspec

from shared.artifacts import ARTIFACTS_PATH, ArtifactFile, ArtifactManifest, ArtifactRef, manifest_url
from shared.manifest import ManifestEntry, manifest_digest


@dataclass
class ArtifactServer:
    url: str = ""
    versions: dict[str, dict[str, bytes]] = field(default_factory=dict)  # digest -> name -> bytes
    blobs: dict[str, bytes] = field(default_factory=dict)  # sha256 -> bytes (the store's side)
    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # (path, headers) of each GET
    corrupt: dict[str, bytes] = field(default_factory=dict)  # file name -> bytes served instead
    die_after: dict[str, int] = field(default_factory=dict)  # file name -> bytes sent before dying
    redirect_to: str | None = None  # answer every request with a 302 there
    presign_via: ArtifactServer | None = None  # files are fetched from this "object store"
    hold: threading.Event | None = None  # file bodies wait for it (a slow download, as long as a test needs)
    resolves: dict[str, bytes] = field(default_factory=dict)  # adapter name -> GET /v1/resolve/{name} body
    lock: threading.Lock = field(default_factory=threading.Lock)

    def publish(self, files: dict[str, bytes]) -> ArtifactRef:
        entries = [ManifestEntry(n, len(b), hashlib.sha256(b).hexdigest()) for n, b in files.items()]
        digest = manifest_digest(entries)
        self.versions[digest] = dict(files)
        return ArtifactRef(digest=digest, url=manifest_url(self.url, digest))

    def publish_folder(self, folder: Path) -> ArtifactRef:
        return self.publish({p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()})

    def manifest(self, digest: str) -> ArtifactManifest:
        files = []
        for name, data in sorted(self.versions[digest].items()):
            sha = hashlib.sha256(data).hexdigest()
            url = None
            if self.presign_via is not None:
                self.presign_via.blobs[sha] = data
                url = f"{self.presign_via.url}/bucket/{sha}?X-Amz-Signature=secret"
            files.append(ArtifactFile(name=name, size=len(data), sha256=sha, url=url))
        return ArtifactManifest(digest=digest, files=files)

    def paths(self) -> list[str]:
        with self.lock:
            return [p for p, _ in self.seen]

    def reply(self, path: str) -> tuple[int, bytes, str | None]:
        """(status, body, name of the file served or None)."""
        clean = path.split("?", 1)[0]
        if clean.startswith("/v1/resolve/"):
            body = self.resolves.get(clean.removeprefix("/v1/resolve/"))
            return (200, body, None) if body is not None else (404, b"{}", None)
        if clean.startswith("/bucket/"):
            blob = self.blobs.get(clean.removeprefix("/bucket/"))
            return (200, blob, None) if blob is not None else (404, b"{}", None)
        parts = clean.removeprefix(ARTIFACTS_PATH + "/").split("/")
        if not clean.startswith(ARTIFACTS_PATH + "/") or parts[0] not in self.versions:
            return 404, b"{}", None
        if len(parts) == 1:
            return 200, msgspec.json.encode(self.manifest(parts[0])), None
        data = self.versions[parts[0]].get(parts[1])
        if data is None:
            return 404, b"{}", None
        return 200, self.corrupt.get(parts[1], data), parts[1]


@contextlib.contextmanager
def serve_artifacts(server: ArtifactServer | None = None) -> Iterator[ArtifactServer]:
    state = server if server is not None else ArtifactServer()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            with state.lock:
                state.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
            if state.redirect_to is not None:
                self.send_response(302)
                self.send_header("location", state.redirect_to + self.path)
                self.send_header("content-length", "0")
                self.end_headers()
                return
            status, body, name = state.reply(self.path)
            if name is not None and state.hold is not None:
                state.hold.wait(timeout=60)
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            if name is not None and name in state.die_after:
                self.wfile.write(body[: state.die_after[name]])
                self.wfile.flush()
                self.close_connection = True  # the rest of the body never comes
                return
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
