"""ArtifactStore: where the control plane keeps every version's bytes, one object per file, named by sha256.

One object-store library (obstore) serves every backend, chosen by URL: `file:///path` (the default,
`.loraplane/artifacts/`), `s3://bucket/prefix` (credentials, region and endpoint from the standard
`AWS_*` variables; `AWS_ENDPOINT_URL` for an S3-compatible server, `AWS_ALLOW_HTTP=true` for plain http),
and whatever else obstore's `from_url` knows (`gs://`, `az://`) where a deployment can reach it.

Layout: `blobs/<sha256>`. Objects are immutable: a key's bytes are the sha256 its name says, written once
(a rewrite of the same key writes the same bytes). Which blobs are still wanted is the database's
business (control_plane/artifacts/blobs.py); this module only moves bytes.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import obstore
from obstore.store import LocalStore, ObjectStore, S3Store, from_url

if TYPE_CHECKING:
    from obstore import GetOptions  # a type only (obstore's stubs: not importable at run time)

BLOB_PREFIX = "blobs/"
STREAM_CHUNK = 1 << 20
PRESIGN_FOR = dt.timedelta(minutes=15)


class ArtifactStoreError(Exception):
    """The store could not be reached or refused an operation (the message names the store, no secret)."""


def blob_key(sha256: str) -> str:
    return BLOB_PREFIX + sha256


class ArtifactStore:
    def __init__(self, url: str) -> None:
        self.url = url
        parts = urlsplit(url)
        self.scheme = parts.scheme
        try:
            if parts.scheme == "file":
                Path(parts.path).mkdir(parents=True, exist_ok=True)
                self._store: ObjectStore = LocalStore(parts.path, mkdir=True)
            else:
                self._store = from_url(url)
        except Exception as exc:  # a malformed URL, an unknown scheme, missing configuration
            raise ArtifactStoreError(f"artifact store {self.safe_url}: {self._reason(exc)}") from None

    @property
    def safe_url(self) -> str:
        """The URL without credentials or query (a store URL may carry them)."""
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.hostname or ''}{parts.path}"

    @property
    def presigns(self) -> bool:
        """Whether engines can be sent presigned URLs, so that bytes bypass the control plane."""
        return isinstance(self._store, S3Store)

    async def has(self, sha256: str, size: int) -> bool:
        try:
            meta = await obstore.head_async(self._store, blob_key(sha256))
        except FileNotFoundError:
            return False
        except Exception as exc:
            raise self._error("head", exc) from None
        return int(meta["size"]) == size

    async def put_file(self, sha256: str, path: Path) -> None:
        """Write a local file (already hashed by the caller) as the blob `sha256`."""
        try:
            await obstore.put_async(self._store, blob_key(sha256), path)
        except Exception as exc:
            raise self._error("put", exc) from None

    async def stream(self, sha256: str, start: int = 0, end: int | None = None) -> AsyncIterator[bytes]:
        """The blob's bytes [start, end), chunk by chunk (never the whole object in memory)."""
        if end is not None and end <= start:
            return  # an empty span (S3 refuses the request that would ask for it)
        if isinstance(self._store, LocalStore):
            async for chunk in self._local_ranges(sha256, start, end):
                yield chunk
            return
        try:
            if start == 0 and end is None:
                result = await obstore.get_async(self._store, blob_key(sha256))
            else:
                options: GetOptions = {"range": (start, end) if end is not None else {"offset": start}}
                result = await obstore.get_async(self._store, blob_key(sha256), options=options)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise self._error("get", exc) from None
        async for chunk in result.stream(min_chunk_size=STREAM_CHUNK):
            yield bytes(chunk)

    async def _local_ranges(self, sha256: str, start: int, end: int | None) -> AsyncIterator[bytes]:
        """A local blob as one ranged read per chunk: obstore's get stream of a local file reads 8 KiB at a
        time, slower than engines fetch; a 1 MiB range is one read (docs/performance.md#artifacts)."""
        key = blob_key(sha256)
        try:
            if end is None:
                end = int((await obstore.head_async(self._store, key))["size"])
            for offset in range(start, end, STREAM_CHUNK):
                yield bytes(await obstore.get_range_async(self._store, key, start=offset,
                                                          end=min(offset + STREAM_CHUNK, end)))
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise self._error("get", exc) from None

    async def download(self, sha256: str, into: Path) -> None:
        with into.open("wb") as fh:
            async for chunk in self.stream(sha256):
                fh.write(chunk)

    async def blobs(self) -> AsyncIterator[tuple[str, int, dt.datetime]]:
        """(sha256, size, last modified) of every blob the store holds, in batches as the store lists them."""
        try:
            async for batch in obstore.list(self._store, prefix=BLOB_PREFIX):
                for meta in batch:
                    name = str(meta["path"]).removeprefix(BLOB_PREFIX)
                    if len(name) == 64 and all(c in "0123456789abcdef" for c in name):
                        yield name, int(meta["size"]), meta["last_modified"]
        except FileNotFoundError:
            return
        except Exception as exc:
            raise self._error("list", exc) from None

    async def delete(self, sha256: str) -> None:
        try:
            await obstore.delete_async(self._store, blob_key(sha256))
        except FileNotFoundError:
            return
        except Exception as exc:
            raise self._error("delete", exc) from None

    async def presign(self, sha256: str) -> str | None:
        store = self._store
        if not isinstance(store, S3Store):  # not self.presigns
            return None
        try:
            return await obstore.sign_async(store, "GET", blob_key(sha256), PRESIGN_FOR)
        except Exception as exc:
            raise self._error("sign", exc) from None

    def _reason(self, exc: Exception) -> str:
        """The first line of obstore's message (the rest is a debug dump), unless it quotes the URL, which
        may carry a password or a signed query: then only the error's kind."""
        line = str(exc).split("\n", 1)[0]
        parts = urlsplit(self.url)
        secrets = [s for s in (parts.password, parts.query) if s]
        return f"cannot be opened ({type(exc).__name__})" if any(s in line for s in secrets) else line

    def _error(self, what: str, exc: Exception) -> ArtifactStoreError:
        return ArtifactStoreError(f"artifact store {self.safe_url}: {what} failed ({type(exc).__name__})")
