"""Where a load's `lora_path` may point, read into a Spool (the engines never read it themselves):

- a local folder under the adapter roots (`--lora-roots`), or the same as `file://…`;
- an object-store prefix, `s3://bucket/prefix/` (credentials, region and endpoint from the `AWS_*`
  variables, as for the artifact store; `gs://`, `az://` likewise where a deployment can reach them);
- a Hugging Face Hub repository, `hf://org/name` or `hf://org/name@revision` (a public one: the files
  are read over HTTPS from `$HF_ENDPOINT`, default https://huggingface.co, as huggingface_hub does).

A folder is validated where it lies first (so refusals name the caller's path and the root rule holds
before anything is read), then copied into the spool (each file checked again where it was opened: a
regular file under the roots) and validated again there: the version recorded is the copy that was
checked, and a folder edited during the copy is refused rather than half-recorded. A tenant key's
lora_path is confined further, to its tenant's sources (control_plane/domain/tenants/sources.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import SplitResult, quote, unquote, urlsplit

import obstore
from obstore.store import from_url

from control_plane.artifacts.inspect import InspectedAdapter, inspect_adapter
from control_plane.artifacts.spool import VERSION_FILES, Spool
from shared.errors import ConflictError, InvalidRequestError
from shared.peft import resolve_under_roots

OBJECT_STORE_SCHEMES = ("s3", "gs", "az", "hf")
HF_ENDPOINT = "https://huggingface.co"
_PROC_FD = Path("/proc/self/fd")  # Linux: where an open file's real path is read back


def split_url(url: str, param: str = "lora_path") -> SplitResult:
    """urlsplit, a URL it cannot parse (an unclosed `[` of an IPv6 host) being a 400 that names `param`."""
    try:
        return urlsplit(url)
    except ValueError as exc:
        raise InvalidRequestError(f"{param} {url[:80]!r} is not a valid URL ({exc})", param=param) from None


def is_object_store_url(lora_path: str) -> bool:
    return split_url(lora_path).scheme in OBJECT_STORE_SCHEMES


def hub_url(lora_path: str) -> str:
    """`hf://org/name[@revision]` → the HTTPS prefix its files are served under (`resolve/<revision>/`)."""
    repo, _, revision = lora_path.removeprefix("hf://").strip("/").partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")) or "/" in revision or ".." in repo + revision:
        raise InvalidRequestError("an hf:// lora_path is hf://org/name or hf://org/name@revision", param="lora_path")
    endpoint = os.environ.get("HF_ENDPOINT", HF_ENDPOINT).rstrip("/")
    return f"{endpoint}/{quote(repo)}/resolve/{quote(revision or 'main', safe='')}/"


async def spool_source(lora_path: str, roots: tuple[str, ...], limit_bytes: int,
                       spool_root: Path) -> tuple[Spool, InspectedAdapter]:
    """The validated files of `lora_path` in a new Spool (under `spool_root`; the caller closes it)."""
    spool = Spool(limit_bytes, spool_root)
    try:
        if is_object_store_url(lora_path):
            await _from_object_store(spool, lora_path)
            found = await asyncio.to_thread(spool.inspect)
        else:
            found = await asyncio.to_thread(_from_folder, spool, local_path(lora_path), roots)
        return spool, found
    except BaseException:
        spool.close()
        raise


def local_path(lora_path: str, param: str = "lora_path") -> str:
    """The folder a lora_path that is no object-store URL names (`file:///…` or a path as it is)."""
    if lora_path.startswith("file://"):
        parts = split_url(lora_path, param)
        if parts.netloc not in ("", "localhost"):
            raise InvalidRequestError(f"a file:// {param} names a local folder (file:///path)", param=param)
        return unquote(parts.path)
    if "://" in lora_path:
        raise InvalidRequestError(f"{param} must be a folder under the adapter roots, file:///…, or one of "
                                  f"{', '.join(s + '://' for s in OBJECT_STORE_SCHEMES)}", param=param)
    return lora_path


def _from_folder(spool: Spool, path: str, roots: tuple[str, ...]) -> InspectedAdapter:
    there = inspect_adapter(path, roots)  # the root rule and every refusal, naming the caller's path
    changed = ConflictError(f"the files in {path!r} changed while they were being read; retry", param="lora_path")
    try:
        for name in VERSION_FILES:
            with open_under(Path(there.path) / name, roots, changed) as source:
                spool.add_reader(name, source)
    except OSError as exc:
        raise InvalidRequestError(f"the adapter files in {path!r} cannot be read ({exc.strerror or type(exc).__name__})",
                                  param="lora_path") from None
    copied = spool.inspect()
    if copied.description.sha256 != there.description.sha256:
        raise changed
    return dataclasses.replace(copied, path=there.path)


def open_under(path: Path, roots: tuple[str, ...], changed: ConflictError) -> BinaryIO:
    """`path` opened for reading, refused (`changed`) unless what was opened is a regular file under the
    roots: a link swapped in after the folder was checked leads nowhere else. Never blocks on a FIFO."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        opened = Path(os.readlink(_PROC_FD / str(fd))) if _PROC_FD.is_dir() else path
        if not stat.S_ISREG(os.fstat(fd).st_mode) or resolve_under_roots(opened, roots) is None:
            raise changed
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


async def _from_object_store(spool: Spool, url: str) -> None:
    prefix = url if url.endswith("/") else url + "/"
    options: dict[str, Any] = {}
    if url.startswith("hf://"):
        prefix = hub_url(url)
        options = {"client_options": {"allow_http": prefix.startswith("http://")}}
    try:
        store = from_url(prefix, **options)
    except Exception as exc:
        raise InvalidRequestError(f"lora_path {_shown(url)} cannot be opened as an object store ({exc})",
                                  param="lora_path") from None
    for name in VERSION_FILES:
        await spool.add_stream(name, _download(store, name, url))


async def _download(store: obstore.store.ObjectStore, name: str, url: str) -> AsyncIterator[bytes]:
    try:
        result = await obstore.get_async(store, name)
    except FileNotFoundError:
        raise InvalidRequestError(f"{name} is missing under {_shown(url)}; is this a PEFT adapter folder?",
                                  param="lora_path") from None
    except Exception as exc:
        raise InvalidRequestError(f"lora_path {_shown(url)}: reading {name} failed ({type(exc).__name__})",
                                  param="lora_path") from None
    async for chunk in result.stream(min_chunk_size=1 << 20):
        yield bytes(chunk)


def _shown(url: str) -> str:
    parts = urlsplit(url)
    return repr(f"{parts.scheme}://{parts.hostname or ''}{parts.path}"[:160])
