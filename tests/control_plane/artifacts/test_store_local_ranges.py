"""A file:// store streams blobs as ranged reads of STREAM_CHUNK (obstore's own get stream of a local file
reads 8 KiB at a time, slower than engines fetch): the bytes and the ranges must be exactly the file's,
the chunks bounded, and a missing blob a FileNotFoundError, as from the stream of any other backend."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from control_plane.artifacts.store import STREAM_CHUNK, ArtifactStore


async def collected(store: ArtifactStore, sha: str, start: int = 0, end: int | None = None) -> list[bytes]:
    return [chunk async for chunk in store.stream(sha, start, end)]


async def test_local_blobs_stream_whole_and_in_ranges(tmp_path: Path) -> None:
    data = os.urandom(2 * STREAM_CHUNK + 12345)  # three chunks, the last one short
    source = tmp_path / "blob"
    source.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    store = ArtifactStore((tmp_path / "store").as_uri())
    await store.put_file(sha, source)

    whole = await collected(store, sha)
    assert b"".join(whole) == data and [len(c) for c in whole] == [STREAM_CHUNK, STREAM_CHUNK, 12345]
    assert b"".join(await collected(store, sha, 100, STREAM_CHUNK + 7)) == data[100:STREAM_CHUNK + 7]
    assert b"".join(await collected(store, sha, len(data) - 5)) == data[-5:]  # start only: to the end
    assert await collected(store, sha, 10, 10) == []

    into = tmp_path / "copy"
    await store.download(sha, into)
    assert into.read_bytes() == data


async def test_a_missing_local_blob_is_file_not_found(tmp_path: Path) -> None:
    store = ArtifactStore((tmp_path / "store").as_uri())
    with pytest.raises(FileNotFoundError):
        await collected(store, "0" * 64)
