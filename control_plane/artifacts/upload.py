"""Reading an upload (`POST /v1/lora_adapters/{name}/versions`) into a Spool as it arrives.

Two bodies are accepted:
- `multipart/form-data`: one file part per PEFT file, named by its filename (`adapter_config.json`,
  `adapter_model.safetensors`), plus the text fields `base_model`, `description`, `activate`, `pinned`, `replicas` (JSON);
- a `.tar.gz` (`application/gzip`, `application/x-gzip`, `application/x-tar`): the two files at the top
  or inside one folder; the fields then come as query parameters.

Nothing is held in memory beyond a chunk: file parts go straight into the spool, whose limit
(`--max-artifact-bytes`) counts the files' bytes (for a tarball, after decompression: a small archive
cannot expand past it); the body itself may exceed that by little (headers, text fields, BODY_OVERHEAD).
A `Content-Length` above that is a 413 before any byte of the body is read. A client that disconnects
mid-way is a refusal like any other (400, audited as such), and one that sends nothing for
`idle_timeout_s` is cut off (408; the server then closes the connection, whose body was not read to the
end); either leaves only the spool, which the caller removes.
"""

from __future__ import annotations

import asyncio
import tarfile
import tempfile
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import multipart
from litestar import Request
from litestar.exceptions import InternalServerException

from control_plane.artifacts.spool import VERSION_FILES, Spool
from shared.errors import InvalidRequestError, PayloadTooLargeError, RequestTimeoutError

FIELDS = ("base_model", "description", "activate", "pinned", "replicas")
MAX_FIELD_BYTES = 8192
BODY_OVERHEAD = 1 << 20  # multipart headers and text fields, on top of the files' own bytes
TAR_TYPES = ("application/gzip", "application/x-gzip", "application/x-tar", "application/x-gtar")
_CHUNK = 1 << 20


@dataclass
class Upload:
    spool: Spool
    fields: dict[str, str] = field(default_factory=dict)


def refuse_declared_size(request: Request[Any, Any, Any], limit_bytes: int) -> None:
    """A 413 for a body whose Content-Length is over the cap, before a byte of it is read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit_bytes + BODY_OVERHEAD:
        raise PayloadTooLargeError(f"the upload's Content-Length ({declared} bytes) is more than --max-artifact-bytes "
                                   f"allows ({limit_bytes} bytes, plus {BODY_OVERHEAD} for the form's own "
                                   "overhead); nothing was read", param="file")


async def receive(request: Request[Any, Any, Any], limit_bytes: int, query: Iterable[tuple[str, str]],
                  idle_timeout_s: float, spool_root: Path) -> Upload:
    """The upload's files in a new Spool (the caller closes it) and its fields."""
    refuse_declared_size(request, limit_bytes)
    content_type, options = multipart.parse_options_header(request.headers.get("content-type", ""))
    upload = Upload(Spool(limit_bytes, spool_root, param="file"))
    try:
        body = _capped(_received(request, idle_timeout_s), limit_bytes + BODY_OVERHEAD)
        if content_type == "multipart/form-data":
            if not options.get("boundary"):
                raise InvalidRequestError("multipart/form-data without a boundary", param="content-type")
            await _multipart(body, options["boundary"], upload)
        elif content_type in TAR_TYPES:
            for key, value in query:
                if key in FIELDS:
                    if key in upload.fields:
                        raise InvalidRequestError(f"query parameter {key!r} is given twice; send it once", param=key)
                    upload.fields[key] = value
            await _tarball(body, upload.spool)
        else:
            raise InvalidRequestError("send the adapter as multipart/form-data (one part per file) or as a "
                                      f".tar.gz ({TAR_TYPES[0]}), not {content_type or 'no content type'}",
                                      param="content-type")
        return upload
    except BaseException:
        upload.spool.close()
        raise


async def _received(request: Request[Any, Any, Any], idle_timeout_s: float) -> AsyncIterator[bytes]:
    chunks = aiter(request.stream())
    while True:
        try:
            async with asyncio.timeout(idle_timeout_s):
                chunk = await anext(chunks)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise RequestTimeoutError(f"the upload sent nothing for {idle_timeout_s:g} s and was cut off "
                                      "(--upload-idle-timeout-s); send it again", param="file") from None
        except InternalServerException:  # Litestar's word for an http.disconnect before the body ended
            raise InvalidRequestError("the client disconnected before the upload ended", param="file") from None
        yield chunk


async def _capped(chunks: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    seen = 0
    async for chunk in chunks:
        seen += len(chunk)
        if seen > limit:
            raise PayloadTooLargeError(f"the upload is larger than --max-artifact-bytes allows ({limit} bytes "
                                       "with the form's own overhead)", param="file")
        yield chunk


async def _multipart(body: AsyncIterator[bytes], boundary: str, upload: Upload) -> None:
    parser = multipart.PushMultipartParser(boundary, max_segment_count=len(FIELDS) + len(VERSION_FILES) + 2,
                                           strict=True)
    writer, text, part = None, bytearray(), None
    try:
        with parser:
            async for chunk in body:
                for event in parser.parse(chunk):
                    if isinstance(event, multipart.MultipartSegment):
                        part = event
                        if event.filename is not None:
                            writer = upload.spool.writer(PurePosixPath(event.filename).name)
                        elif event.name not in FIELDS:
                            raise InvalidRequestError(f"unknown form field {event.name[:64]!r}; the fields are "
                                                      f"{', '.join(FIELDS)} and the files", param=event.name[:64])
                    elif event:  # a piece of the current part's content
                        if writer is not None:
                            writer.write(bytes(event))
                        else:
                            text += event
                            if len(text) > MAX_FIELD_BYTES:
                                assert part is not None  # the parser yields a part's header before its content
                                raise InvalidRequestError(f"form field {part.name!r} is too long", param=part.name)
                    else:  # the part ended
                        if writer is not None:
                            writer.finish()
                            writer = None
                        elif part is not None:
                            if part.name in upload.fields:
                                raise InvalidRequestError(f"form field {part.name!r} is given twice; send it once",
                                                          param=part.name)
                            upload.fields[part.name] = text.decode("utf-8", errors="replace")
                        text, part = bytearray(), None
    except multipart.MultipartError as exc:
        raise InvalidRequestError(f"the multipart body is malformed ({exc})", param="file") from None
    finally:
        if writer is not None:
            writer.abort()


async def _tarball(body: AsyncIterator[bytes], spool: Spool) -> None:
    """The archive goes to a temporary file first (tarfile reads synchronously), then its two members
    into the spool, in a thread."""
    with tempfile.TemporaryFile() as raw:
        async for chunk in body:
            raw.write(chunk)
        raw.seek(0)
        await asyncio.to_thread(_extract, raw, spool)


def _extract(raw: object, spool: Spool) -> None:
    folder: PurePosixPath | None = None  # where the first file lay: the other must lie there too
    try:
        with tarfile.open(fileobj=raw, mode="r|*") as archive:  # type: ignore[call-overload]
            for member in archive:
                name = PurePosixPath(member.name)
                if member.isdir() or name.name.startswith("._"):  # folders; macOS resource forks
                    continue
                plain = not name.is_absolute() and ".." not in name.parts and len(name.parts) <= 2
                if (not member.isreg() or not plain or name.name not in VERSION_FILES
                        or (folder is not None and name.parent != folder)):
                    raise InvalidRequestError(f"the archive holds {member.name[:80]!r}; it may hold only "
                                              f"{' and '.join(VERSION_FILES)}, at its top or in one folder",
                                              param="file")
                folder = name.parent
                source = archive.extractfile(member)
                assert source is not None  # a regular file
                with spool.writer(name.name) as writer:
                    while chunk := source.read(_CHUNK):
                        writer.write(chunk)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise InvalidRequestError(f"the body is not a readable .tar.gz ({type(exc).__name__})", param="file") from None
