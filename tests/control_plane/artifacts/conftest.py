"""An S3 API server for the artifact tests: moto's server mode on loopback, one per test package.

The store and the `s3://` sources then talk real S3 over HTTP (signatures, ranges, presigned URLs) to a
server that is not ours. Without moto these tests skip, unless CI is set (then a missing server fails).

`hub`: the Hub cannot be reached here, so a real local HTTP server lays the demo adapters out as the Hub
serves a repository's files (`org/poet`: demo-poet at main, demo-short at v2), with HF_ENDPOINT pointing
at it; it notes every path it was asked for.
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

BUCKET = "artifacts"
KEYS = {"AWS_ACCESS_KEY_ID": "test-access-key", "AWS_SECRET_ACCESS_KEY": "test-secret-key",
        "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}


@dataclass(frozen=True)
class S3:
    endpoint: str
    prefix: str  # this test's own key prefix in BUCKET

    @property
    def url(self) -> str:
        return f"s3://{BUCKET}/{self.prefix}"

    def keys(self, under: str = "") -> list[str]:
        """The keys below this test's prefix (+ `under`), listed over the S3 API itself."""
        r = httpx.get(f"{self.endpoint}/{BUCKET}", params={"list-type": "2", "prefix": f"{self.prefix}/{under}"},
                      timeout=10)
        r.raise_for_status()
        return [part.split("</Key>", 1)[0].removeprefix(f"{self.prefix}/") for part in r.text.split("<Key>")[1:]]

    def put(self, key: str, data: bytes) -> None:
        httpx.put(f"{self.endpoint}/{BUCKET}/{self.prefix}/{key}", content=data, timeout=10).raise_for_status()


def require_moto() -> None:
    try:
        import moto.server  # noqa: F401
    except ImportError as exc:
        reason = f"moto's server mode is not installed ({exc}); pip install 'moto[server]'"
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI is set: a missing S3 server is a failure there)")
        pytest.skip(reason)


@pytest.fixture(scope="package")
def moto_endpoint() -> Iterator[str]:
    require_moto()
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    # moto accepts unsigned bucket creation (its default account); the store's own requests are signed
    httpx.put(f"{endpoint}/{BUCKET}", timeout=10).raise_for_status()
    try:
        yield endpoint
    finally:
        server.stop()


@pytest.fixture
def s3(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> S3:
    """The standard AWS_* variables pointing at moto, and a fresh key prefix for this test."""
    for key, value in {**KEYS, "AWS_ENDPOINT_URL": moto_endpoint}.items():
        monkeypatch.setenv(key, value)
    return S3(moto_endpoint, f"t-{uuid.uuid4().hex[:12]}")


@dataclass
class Hub:
    url: str
    asked: list[str] = field(default_factory=list)  # the paths requested, in order


class _NotingHandler(SimpleHTTPRequestHandler):
    def __init__(self, *args, hub: Hub, **kwargs) -> None:  # noqa: ANN002, ANN003 (the server's own arguments)
        self.hub = hub
        super().__init__(*args, **kwargs)

    def send_head(self):  # noqa: ANN201 (GET and HEAD both come here)
        self.hub.asked.append(self.path)
        return super().send_head()


@pytest.fixture
def hub(tmp_path: Path, demo: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> Iterator[Hub]:
    served = tmp_path / "hub"
    for revision in ("main", "v2"):
        shutil.copytree(demo["demo-poet" if revision == "main" else "demo-short"],
                        served / "org" / "poet" / "resolve" / revision)
    found = Hub("")
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_NotingHandler, hub=found, directory=str(served)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    found.url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", found.url)
    try:
        yield found
    finally:
        server.shutdown()
        server.server_close()
