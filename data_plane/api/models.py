"""The one place where the OpenAI `model` name becomes an adapter: a Lease from the registry.

The base model's served name → adapter id 0 (a no-op lease); a loaded adapter's name → a lease
that counts the request in flight until it is released (Generation.aclose); any other name → 404,
never a silent fallback to the base model. With a control plane (`remote`), an unknown name is first
resolved there and, if registered, loaded through the registry like POST /v1/load_lora_adapter.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from data_plane.adapters.artifact_source import ArtifactSource
from data_plane.adapters.entry import BASE_ADAPTER_ID, Lease
from data_plane.adapters.registry import LoRARegistry
from data_plane.lora.errors import LoRANotFoundError
from shared.engine_admin import ResolvedAdapter
from shared.errors import LoraplaneError, NotFoundError

__all__ = ["BASE_ADAPTER_ID", "ModelResolver", "Remote"]
logger = logging.getLogger(__name__)

# name -> where its active version lies and its manifest digest, or None when nobody registered it
Remote = Callable[[str], Awaitable[ResolvedAdapter | None]]


class ModelResolver:
    def __init__(
        self,
        served_model_name: str,
        model_path: str,
        max_model_len: int,
        registry: LoRARegistry | None = None,  # None: LoRA is off, only the base model is served
        remote: Remote | None = None,  # the control plane's resolve; None: unknown names are 404
        artifacts: ArtifactSource | None = None,  # fetches resolved versions named by digest
    ) -> None:
        self.served_model_name = served_model_name
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.registry = registry
        self.remote = remote
        self.artifacts = artifacts
        self.created = int(time.time())

    async def acquire(self, name: str) -> Lease:
        """A lease on the model `name`; NotFoundError (404) when no such model is served."""
        if name == self.served_model_name:
            return Lease.base(name)
        if self.registry is None:
            raise _not_found(name)
        try:
            return await self.registry.acquire(name)
        except LoRANotFoundError:
            if self.remote is None or not await self._pull(name):
                raise
        return await self.registry.acquire(name)

    async def _pull(self, name: str) -> bool:
        """Load `name` from where the control plane says its active version lies; False if it does not know it."""
        assert self.registry is not None and self.remote is not None
        resolved = await self.remote(name)
        if resolved is None:
            return False
        path = resolved.uri
        try:  # only the recorded bytes: files edited since the version was registered are refused
            if resolved.artifact is not None and self.artifacts is not None:  # fetched by digest, verified
                path = resolved.artifact.url
                await self.artifacts.load(name, resolved.artifact, load_inplace=True, version=resolved.version or None)
            else:
                await self.registry.load(name, path, load_inplace=True, expected_sha256=resolved.sha256,
                                         version=resolved.version or None)
        except LoraplaneError as exc:
            logger.warning("adapter %s resolved by the control plane cannot be loaded from %s: %s", name, path,
                           exc.message)
            raise
        logger.info("loaded adapter %s version %d on demand from %s (resolved by the control plane)", name,
                    resolved.version, path)
        return True

    async def acquire_many(self, name: str, count: int) -> list[Lease]:
        """One lease per engine request of a batched prompt; all or none."""
        leases: list[Lease] = []
        try:
            for _ in range(count):
                leases.append(await self.acquire(name))
        except BaseException:
            for lease in leases:
                lease.release()
            raise
        return leases

    def card(self, name: str, *, show_paths: bool = True) -> dict[str, Any]:
        """GET /v1/models/{name}: the card, or NotFoundError like any other use of an unknown name."""
        for card in self.cards(show_paths=show_paths):
            if card["id"] == name:
                return card
        raise _not_found(name)

    def cards(self, *, show_paths: bool = True) -> list[dict[str, Any]]:
        """GET /v1/models entries (OpenAI shape plus vLLM's root / parent / max_model_len). `root` is
        where the files lie (as in vLLM) for callers allowed to see the engine's paths; for everyone
        else it is the model's own name, so an open listing does not map the engine's disk. An adapter's
        entry adds `version`: the control plane registry's version number (None: loaded directly)."""
        base_root = self.model_path if show_paths else self.served_model_name
        cards = [self._card(self.served_model_name, self.created, base_root, None)]
        if self.registry is not None:
            cards += [
                {**self._card(e.name, int(e.loaded_at), e.path if show_paths else e.name, self.served_model_name),
                 "version": e.version}
                for e in sorted(self.registry.ready(), key=lambda e: e.name)
            ]
        return cards

    def _card(self, name: str, created: int, root: str, parent: str | None) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "loraplane",
            "root": root,
            "parent": parent,
            "max_model_len": self.max_model_len,
        }


def _not_found(name: str) -> NotFoundError:
    return NotFoundError(f"The model `{name}` does not exist.", param="model", code="model_not_found")
