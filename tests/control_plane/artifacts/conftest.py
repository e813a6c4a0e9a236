"""An S3 API server for the artifact tests: moto's server mode on loopback, one per test package.

The store and the `s3://` sources then talk real S3 over HTTP (signatures, ranges, presigned URLs) to a
server that is not ours. Without moto these tests skip, unless CI is set (then a missing server fails).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

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
