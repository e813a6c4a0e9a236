"""What engines fetch: a version's manifest and its files, by digest (shared/artifacts.py).

`GET /v1/artifacts/{digest}` answers the manifest (each file's name, size, sha256; with an S3 store also a
presigned URL per file, so the bytes bypass the control plane). `GET /v1/artifacts/{digest}/{file}`
streams one file from the store, a single `Range: bytes=a-b` answered with 206. Engine tokens may call
both (any engine: the control plane decides what goes where), as may admin and read tokens.

Pacing (no rate limit here): a file is sent as fast as the engine takes it. Engines read it from a
low-priority, paced thread behind a 1 MiB receive window (data_plane/adapters/artifacts/download.py), so
TCP flow control stops this process from sending, and from taking a CPU, whenever the engine's forward
pass has the cores; on an idle engine the same fetch runs at full speed. A fixed rate limit would slow the
cold load of an idle engine as much as it spared a busy one (bench/artifacts.py measures both).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Annotated, Any

from litestar import Controller, Response, get
from litestar.datastructures import State
from litestar.params import Parameter
from litestar.response import Stream
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.artifacts.store import ArtifactStore, ArtifactStoreError
from control_plane.auth import read_guard
from control_plane.db.models import AdapterVersion, ArtifactBlob, VersionFile
from control_plane.db.transaction import read
from control_plane.metrics import ControlPlaneMetrics
from shared.artifacts import (
    ARTIFACTS_PATH,
    DIGEST_PATTERN,
    FILE_NAME_PATTERN,
    ArtifactFile,
    ArtifactManifest,
    Digest,
    FileName,
)
from shared.errors import InvalidRequestError, LoraplaneError, NotFoundError, OverloadedError
from shared.http_errors import error_body
from shared.openapi import route_doc

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


async def _files(session: AsyncSession, digest: str) -> list[tuple[str, str, int]]:
    """(name, sha256, size) of the version with this manifest digest (any adapter: same digest, same files)."""
    version_id = select(AdapterVersion.id).where(AdapterVersion.sha256 == digest).limit(1).scalar_subquery()
    rows = (await session.execute(
        select(VersionFile.name, ArtifactBlob.sha256, ArtifactBlob.size)
        .join(ArtifactBlob, ArtifactBlob.id == VersionFile.blob_id)
        .where(VersionFile.adapter_version_id == version_id).order_by(VersionFile.name))).all()
    if not rows:
        raise NotFoundError(f"no version with digest {digest} is in the artifact store", param="digest")
    return [(name, sha, size) for name, sha, size in rows]


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """[start, end) of a single-range request, None for the whole file."""
    if not header:
        return None
    m = _RANGE.match(header.strip())
    if m is None or (not m[1] and not m[2]):
        raise InvalidRequestError("Range must be one range, bytes=START-END, bytes=START- or bytes=-SUFFIX",
                                  param="Range")
    if not m[1]:  # the last N bytes
        start, end = max(0, size - int(m[2])), size
    else:
        start, end = int(m[1]), (min(int(m[2]) + 1, size) if m[2] else size)
    if start >= size or start >= end:
        raise _Unsatisfiable(size)
    return start, end


class _Unsatisfiable(Exception):
    def __init__(self, size: int) -> None:
        self.size = size


class ArtifactController(Controller):
    path = ARTIFACTS_PATH
    tags = ["artifacts"]
    guards = [read_guard]
    opt = {"engine_role": True}  # any engine's token may fetch

    @get("/{digest:str}", operation_id="getArtifactManifest",
         opt=route_doc(response=ArtifactManifest, errors=(400, 404), path_params={"digest": Digest}))
    async def manifest(self, db_session: AsyncSession, state: State,
                       digest: Annotated[str, Parameter(pattern=DIGEST_PATTERN)]) -> ArtifactManifest:
        """The version's manifest: its files' names, sizes and sha256 (they hash to `digest`), and with an
        S3 store a presigned URL per file (valid 15 minutes)."""
        files = await read(db_session, lambda: _files(db_session, digest), f"manifest {digest[:12]}")
        store: ArtifactStore = state.artifact_store
        return ArtifactManifest(digest=digest, files=[
            ArtifactFile(name=name, size=size, sha256=sha, url=await store.presign(sha)) for name, sha, size in files])

    @get("/{digest:str}/{name:str}", operation_id="getArtifactFile",
         opt=route_doc(errors=(400, 404, 416), path_params={"digest": Digest, "name": FileName},
                       media_type="application/octet-stream", alternates=(206,),
                       response_description="The file's bytes; 206 with Content-Range for a Range request."))
    async def file(self, db_session: AsyncSession, state: State,
                   digest: Annotated[str, Parameter(pattern=DIGEST_PATTERN)],
                   name: Annotated[str, Parameter(pattern=FILE_NAME_PATTERN)],
                   range_header: Annotated[str | None, Parameter(header="Range", required=False)] = None,
                   ) -> Response[Any]:
        """One file of the version, streamed from the store (engine tokens too). `Range: bytes=a-b` →
        206 with `Content-Range`; a range past the end → 416."""
        files = await read(db_session, lambda: _files(db_session, digest), f"artifact {digest[:12]}")
        found = [(sha, size) for n, sha, size in files if n == name]
        if not found:
            raise NotFoundError(f"version {digest[:12]}… has no file {name[:64]!r}", param="name")
        sha, size = found[0]
        await db_session.commit()  # end the read: the stream may take long, holding no transaction
        try:
            span = _byte_range(range_header, size)
        except _Unsatisfiable:
            return error_body(416, f"the range lies outside the file ({size} bytes)", param="Range",
                              headers={"Content-Range": f"bytes */{size}"})
        store: ArtifactStore = state.artifact_store
        start, end = span or (0, size)
        headers = {"Accept-Ranges": "bytes", "Content-Length": str(end - start), "X-Content-SHA256": sha}
        body = _counted(await _started(store.stream(sha, start, None if span is None else end), sha), state.metrics)
        if span is None:
            return Stream(body, media_type="application/octet-stream", headers=headers)
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        return Stream(body, status_code=206, media_type="application/octet-stream", headers=headers)


async def _started(chunks: AsyncIterator[bytes], sha: str) -> AsyncIterator[bytes]:
    """The stream with its first chunk already read: a blob gone from the store, or a store that cannot be
    reached, is then an error answer instead of a 200 whose body breaks off after the headers."""
    try:
        first = await anext(chunks, None)
    except FileNotFoundError:
        raise LoraplaneError(f"blob {sha} is listed but missing from the artifact store") from None
    except ArtifactStoreError as exc:
        raise OverloadedError(f"{exc}; retry") from None

    async def rest() -> AsyncIterator[bytes]:
        if first is not None:
            yield first
            async for chunk in chunks:
                yield chunk

    return rest()


async def _counted(chunks: AsyncIterator[bytes], metrics: ControlPlaneMetrics) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        metrics.artifact_bytes.inc(len(chunk))
        yield chunk
