"""VersionLoader: the one way a recorded version is loaded onto an engine, for pushes and reconciles alike.

A version whose files are in the artifact store is named by its digest (shared.artifacts.ArtifactRef):
the engine fetches and verifies the bytes itself, which may take a while for a large adapter
(`ControlPlaneSettings.load_deadline_s`: the engine deadline plus the version's size at
`engine_fetch_min_mbps`). A version recorded before the store existed is still sent as its folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from control_plane.engine_client import EngineAt, EngineCallError, EngineClient
from control_plane.settings import ControlPlaneSettings
from shared.artifacts import ArtifactRef, manifest_url


@dataclass(frozen=True)
class RecordedVersion:
    """What an engine is told to load: the version's digest, and its files in the artifact store
    (`in_store`) or, for versions recorded before the store existed, the folder at `uri`."""

    sha256: str
    uri: str
    in_store: bool
    size_bytes: int
    number: int | None = None  # the registry's version number, which the engine lists as `version`


class VersionLoader:
    """The one way a recorded version is loaded onto an engine, for pushes and reconciles alike."""

    def __init__(self, client: EngineClient, settings: ControlPlaneSettings) -> None:
        self.client = client
        self.public_url = settings.public_url or ""  # "": a path the engine resolves against its control plane
        self.settings = settings

    def deadline_s(self, version: RecordedVersion) -> float:
        return self.settings.load_deadline_s(version.size_bytes) if version.in_store else self.settings.engine_timeout_s

    def artifact_ref(self, digest: str) -> ArtifactRef:
        return ArtifactRef(digest=digest, url=manifest_url(self.public_url, digest))

    async def load(self, engine: EngineAt, adapter: str, version: RecordedVersion, *, pinned: bool) -> None:
        """Load with `expected_sha256`: the engine refuses files that are not those bytes (409
        sha256_mismatch; an artifact's files are checked against the digest as they arrive). An engine
        that answers with another digest anyway (one that ignores the field) is a failure too, so `loaded`
        is only ever recorded for the recorded bytes."""
        if version.in_store:
            ref = self.artifact_ref(version.sha256)
            loaded = await self.client.load(engine, adapter, None, artifact=ref, pinned=pinned, load_inplace=True,
                                            expected_sha256=version.sha256, deadline_s=self.deadline_s(version),
                                            **_numbered(version))
        else:
            loaded = await self.client.load(engine, adapter, version.uri, pinned=pinned, load_inplace=True,
                                            expected_sha256=version.sha256, **_numbered(version))
        if loaded.sha256 != version.sha256:
            raise EngineCallError(f"the engine loaded sha256 {loaded.sha256[:16]}…, not the recorded "
                                  f"{version.sha256[:16]}…")


def _numbered(version: RecordedVersion) -> dict[str, Any]:
    """The load body's `version` field: the registry's number, when known."""
    return {} if version.number is None else {"version": version.number}
