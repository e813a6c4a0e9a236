"""Adapter artifacts on the wire: how an engine learns which bytes a version is and where to fetch them.

The control plane owns every version's bytes, content-addressed: each file by its sha256, the version by
its manifest digest (shared.manifest). A push names the version as an `ArtifactRef` instead of a path:

    POST /v1/load_lora_adapter {"lora_name": "poet", "artifact": {"digest": "<manifest digest>",
                                                                  "url": "<control plane>/v1/artifacts/<digest>"}}

The engine then
1. resolves `url` against its own `--control-plane` URL (the control plane sends a path, `/v1/artifacts/
   <digest>`, unless it was told its public URL) and checks that the result lies on an origin it was
   configured to trust (its control plane, or the artifact store's endpoint): never a URL taken from a
   body as it is;
2. `GET`s the manifest (`ArtifactManifest`, with its engine token) and checks that the files it lists
   hash to `digest` (`manifest_matches`);
3. fetches each file from `ArtifactFile.url` when given (a presigned store URL, same origin rule) or else
   from `file_url(origin, digest, name)` on the control plane, hashing as it writes, and refuses the
   load on any mismatch (`checksum mismatch for adapter_model.safetensors`) before a byte reaches the
   loader.

Torch-free: both halves and the router import it. Extend additively (unknown fields are ignored).
"""

from __future__ import annotations

import re
from typing import Annotated
from urllib.parse import quote

import msgspec

from shared.manifest import ManifestEntry, manifest_digest

ARTIFACTS_PATH = "/v1/artifacts"
DIGEST_PATTERN = "^[0-9a-f]{64}$"
# a file inside a version: a plain name (the manifest's own rule), short enough for any file system
FILE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_FILE_NAME = re.compile(FILE_NAME_PATTERN)

Digest = Annotated[str, msgspec.Meta(pattern=DIGEST_PATTERN, description="sha256, 64 lower-case hex digits")]
FileName = Annotated[str, msgspec.Meta(pattern=FILE_NAME_PATTERN)]
Url = Annotated[str, msgspec.Meta(max_length=4096)]
Size = Annotated[int, msgspec.Meta(ge=0)]


class ArtifactRef(msgspec.Struct, kw_only=True):
    """A version named by content: its manifest digest and where its manifest is served."""

    digest: Digest
    url: Url  # absolute, or a path on the engine's own control plane (`manifest_url("", digest)`)


class ArtifactFile(msgspec.Struct, kw_only=True):
    name: FileName
    size: Size
    sha256: Digest
    url: Url | None = None  # a presigned object-store URL (bytes then bypass the control plane)


class ArtifactManifest(msgspec.Struct, kw_only=True):
    """`GET /v1/artifacts/{digest}`: the version's files; they hash to `digest` (shared.manifest)."""

    digest: Digest
    files: list[ArtifactFile]

    @property
    def size_bytes(self) -> int:
        return sum(f.size for f in self.files)


def is_file_name(name: str) -> bool:
    return bool(_FILE_NAME.match(name))


def manifest_matches(manifest: ArtifactManifest) -> bool:
    """Whether the listed files are the version `digest` names (a manifest cannot vouch for itself)."""
    try:
        entries = [ManifestEntry(f.name, f.size, f.sha256) for f in manifest.files]
        return manifest_digest(entries) == manifest.digest
    except ValueError:  # a name listed twice
        return False


def manifest_url(origin: str, digest: str) -> str:
    return f"{origin.rstrip('/')}{ARTIFACTS_PATH}/{digest}"


def file_url(origin: str, digest: str, name: str) -> str:
    return f"{manifest_url(origin, digest)}/{quote(name, safe='')}"
