"""Adapters named by digest (a push's or a resolve's `artifact`): fetched into the cache, then loaded by
the registry like any folder, with the digest as the expected manifest digest.

The cached folder is read by the same PEFT loader as a `lora_path`, but under the cache folder only
(loading/spec.py: `AdapterReading.of(config, cache_dir)`): adapters from the control plane need no
--lora-roots. The loader digests what it reads and the registry refuses another digest, so a cached folder whose files
changed on disk since they were verified is dropped and fetched once more, never served.

Nothing here touches the engine's step loop: the files are received and hashed in low-priority threads
that rest while the engine is busy (artifacts/download.py, data_plane.background.BackgroundPace), the
registry's load parses the verified bytes off the loop (from memory, adopting the host copy staged while
they arrived: loading/staging.py; the cache writes its copy in the background once the load has its
weights), as it reads any path.

The artifacts side (artifacts/) takes plain parameters and knows neither the engine's config nor torch:
`artifact_cache_for` builds it from the EngineConfig, with loading's TensorStage as the download's stage.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from data_plane.adapters.artifacts.cache import ArtifactCache, ArtifactStats
from data_plane.adapters.artifacts.fetch import ArtifactFetcher, ArtifactOrigins
from data_plane.adapters.loading.staging import TensorStage
from data_plane.adapters.registry import LoRARegistry
from data_plane.background import BackgroundPace, read_off_loop
from data_plane.config import EngineConfig
from data_plane.lora.errors import LoRAConflictError
from shared.artifacts import ArtifactRef


class ArtifactSource:
    def __init__(self, registry: LoRARegistry, cache: ArtifactCache) -> None:
        self.registry = registry
        self.cache = cache
        # the digests the registry serves (any state): their files may be re-read, so never evicted
        cache.in_use = lambda: {entry.description.sha256 for entry in registry.entries()}

    async def open(self) -> None:
        await read_off_loop(self.cache.open)

    async def close(self) -> None:
        await self.cache.settle()  # what was fetched is cached, so the next start need not fetch it
        await read_off_loop(self.cache.close)
        await self.cache.fetcher.aclose()

    async def load(self, name: str, ref: ArtifactRef, *, pinned: bool = False, load_inplace: bool = False,
                   version: int | None = None) -> dict[str, Any]:
        """The registry's load reply for `name` from the version `ref` names (`version`: the control
        plane registry's number of it)."""
        try:
            return await self._load(name, ref, pinned, load_inplace, version)
        except LoRAConflictError as exc:
            if exc.code != "sha256_mismatch":
                raise
        await self.cache.discard(ref.digest)  # verified once, changed since: fetch again
        return await self._load(name, ref, pinned, load_inplace, version)

    async def _load(self, name: str, ref: ArtifactRef, pinned: bool, load_inplace: bool,
                    version: int | None) -> dict[str, Any]:
        async with self.cache.acquire(ref) as folder:  # held: not evicted before the registry serves it
            return await self.registry.load(name, str(folder), pinned=pinned, load_inplace=load_inplace,
                                            expected_sha256=ref.digest, version=version)


def cache_dir_for(config: EngineConfig) -> tuple[Path, bool]:
    """(the cache folder, whether it is this process's temporary one, removed at shutdown)."""
    if config.lora_cache_dir is not None:
        return Path(config.lora_cache_dir).expanduser(), False
    return Path(tempfile.gettempdir()) / f"loraplane-lora-cache-{os.getpid()}-{secrets.token_hex(3)}", True


def artifact_cache_for(config: EngineConfig, busy: Callable[[], bool]) -> ArtifactCache:
    """busy: whether the engine has requests (downloads and the cache's writes rest between pieces then)."""
    root, temporary = cache_dir_for(config)
    stats = ArtifactStats()

    def received(n: int) -> None:
        stats.fetched_bytes += n

    fetcher = ArtifactFetcher(
        ArtifactOrigins(config.control_plane_url, config.lora_artifact_endpoint), config.control_plane_token,
        max_bytes=config.lora_cache_max_bytes, on_bytes=received, pace=BackgroundPace(busy), stage=TensorStage)
    return ArtifactCache(root, config.lora_cache_max_bytes, fetcher, stats=stats, remove_on_close=temporary)
