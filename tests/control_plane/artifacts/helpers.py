"""What the artifact tests send (uploads, tarballs) and what they check against: the database's blob and
manifest rows, and the objects that really lie in a file:// store's folder."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from litestar.testing import AsyncTestClient

from control_plane.db.models import Adapter, AdapterVersion, ArtifactBlob, VersionFile
from control_plane.settings import ControlPlaneSettings
from shared.peft import CONFIG_NAME, WEIGHTS_NAME
from tests.control_plane.conftest import admin
from tests.control_plane.domain.adapters.helpers import fetch_all

ADAPTERS = "/v1/lora_adapters"
FILES = (CONFIG_NAME, WEIGHTS_NAME)

Client = AsyncTestClient | httpx.AsyncClient


def files_of(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in FILES}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def upload(client: Client, name: str, folder: Path, **fields: str) -> httpx.Response:
    """A multipart upload of the folder's two files, one part each, with text `fields`."""
    parts = [("files", (n, data, "application/octet-stream")) for n, data in files_of(folder).items()]
    return await client.post(f"{ADAPTERS}/{name}/versions", headers=admin(), files=parts,
                             data={"base_model": "demo", **fields})


def tarball(members: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    """A .tar.gz of regular files (`name -> bytes`) and symbolic links (`name -> target`)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            archive.addfile(info)
    return out.getvalue()


async def post_tarball(client: Client, name: str, body: bytes, **query: str) -> httpx.Response:
    return await client.post(f"{ADAPTERS}/{name}/versions", headers={**admin(), "Content-Type": "application/gzip"},
                             content=body, params={"base_model": "demo", **query})


def store_folder(settings: ControlPlaneSettings) -> Path:
    assert settings.artifact_store is not None and settings.artifact_store.startswith("file://")
    return Path(urlsplit(settings.artifact_store).path)


def stored_objects(settings: ControlPlaneSettings) -> list[str]:
    """The sha256 of every object in the file:// store (the names under blobs/), checked to be its bytes."""
    blobs = store_folder(settings) / "blobs"
    found = sorted(p.name for p in blobs.iterdir()) if blobs.exists() else []
    for name in found:
        assert sha((blobs / name).read_bytes()) == name, f"the object {name} does not hold its own bytes"
    return found


async def blob_rows(url: str) -> list[str]:
    return sorted(b.sha256 for b in await fetch_all(url, ArtifactBlob))


async def recorded(url: str) -> tuple[int, int, int, int]:
    """How many adapters, versions, manifest rows and blob rows the database holds."""
    return (len(await fetch_all(url, Adapter)), len(await fetch_all(url, AdapterVersion)),
            len(await fetch_all(url, VersionFile)), len(await fetch_all(url, ArtifactBlob)))
