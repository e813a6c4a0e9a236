"""ArtifactStore on both tested backends, through the same calls: a file:// folder and S3 (moto's server
on loopback). Bytes, ranges, existence, deletion and presigning are checked against the data written and,
for S3, against what the S3 API itself lists and serves."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import httpx
import pytest

from control_plane.artifacts.store import STREAM_CHUNK, ArtifactStore, ArtifactStoreError, blob_key
from tests.control_plane.artifacts.conftest import S3

DATA = os.urandom(STREAM_CHUNK + 4321)  # more than one chunk
SHA = hashlib.sha256(DATA).hexdigest()


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    if request.param == "file":
        return ArtifactStore((tmp_path / "store").as_uri())
    s3: S3 = request.getfixturevalue("s3")
    return ArtifactStore(s3.url)


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "blob"
    path.write_bytes(DATA)
    return path


async def read(store: ArtifactStore, start: int = 0, end: int | None = None) -> bytes:
    return b"".join([chunk async for chunk in store.stream(SHA, start, end)])


async def test_put_has_stream_delete(store: ArtifactStore, source: Path, tmp_path: Path) -> None:
    assert not await store.has(SHA, len(DATA))
    await store.put_file(SHA, source)
    assert await store.has(SHA, len(DATA))
    assert not await store.has(SHA, len(DATA) + 1)  # a blob of another size is not this one
    assert await read(store) == DATA
    await store.put_file(SHA, source)  # a rewrite of an immutable key: same bytes, no error
    assert await read(store) == DATA
    into = tmp_path / "copy"
    await store.download(SHA, into)
    assert into.read_bytes() == DATA
    await store.delete(SHA)
    assert not await store.has(SHA, len(DATA))
    await store.delete(SHA)  # deleting what is gone is not an error (a collection may run twice)
    with pytest.raises(FileNotFoundError):
        await read(store)


@pytest.mark.parametrize(("start", "end"), [(0, 1), (10, 20), (STREAM_CHUNK - 3, STREAM_CHUNK + 5),
                                            (len(DATA) - 1, None), (100, None), (0, len(DATA)), (10, 10)])
async def test_ranges_are_the_bytes_of_that_span(store: ArtifactStore, source: Path, start: int, end: int | None) -> None:
    await store.put_file(SHA, source)
    assert await read(store, start, end) == DATA[start:end]


async def test_only_s3_presigns_and_its_url_serves_the_blob(store: ArtifactStore, source: Path) -> None:
    await store.put_file(SHA, source)
    url = await store.presign(SHA)
    if store.scheme == "file":
        assert not store.presigns and url is None
        return
    assert store.presigns and url is not None
    assert blob_key(SHA) in url and "X-Amz-Signature=" in url and "X-Amz-Expires=900" in url  # 15 minutes
    r = httpx.get(url, timeout=10)  # no credentials of our own: the signature is the authority
    assert r.status_code == 200 and r.content == DATA


async def test_s3_objects_live_under_the_prefix(s3: S3, source: Path) -> None:
    store = ArtifactStore(s3.url)
    await store.put_file(SHA, source)
    assert s3.keys() == [blob_key(SHA)]
    await store.delete(SHA)
    assert s3.keys() == []


def test_a_bad_store_url_is_an_error_that_names_no_secret() -> None:
    with pytest.raises(ArtifactStoreError) as caught:
        ArtifactStore("nosuch://user:hunter2@host/path")
    assert "hunter2" not in str(caught.value) and "nosuch://host/path" in str(caught.value)
    with pytest.raises(ArtifactStoreError) as caught:
        ArtifactStore("az://account:hunter2@container/path")  # a scheme settings allow
    assert "hunter2" not in str(caught.value) and "\n" not in str(caught.value)
    assert ArtifactStore("file:///tmp/x").safe_url == "file:///tmp/x"


async def test_an_unreachable_s3_endpoint_is_a_store_error(monkeypatch: pytest.MonkeyPatch, s3: S3) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # nothing listens there
    store = ArtifactStore(s3.url)
    with pytest.raises(ArtifactStoreError, match=r"artifact store s3://artifacts/.*: head failed"):
        await store.has(SHA, len(DATA))
