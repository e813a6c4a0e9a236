"""The one place where the OpenAI `model` name becomes an adapter: a Lease from the registry.

The base model's served name → adapter id 0 (a no-op lease); a loaded adapter's name → a lease
that counts the request in flight until it is released (Generation.aclose); any other name → 404,
never a silent fallback to the base model.
"""

from __future__ import annotations

import time
from typing import Any

from data_plane.lora.entry import BASE_ADAPTER_ID, Lease
from data_plane.lora.registry import LoRARegistry
from shared.errors import NotFoundError

__all__ = ["BASE_ADAPTER_ID", "ModelResolver"]


class ModelResolver:
    def __init__(
        self,
        served_model_name: str,
        model_path: str,
        max_model_len: int,
        registry: LoRARegistry | None = None,  # None: LoRA is off, only the base model is served
    ) -> None:
        self.served_model_name = served_model_name
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.registry = registry
        self.created = int(time.time())

    async def acquire(self, name: str) -> Lease:
        """A lease on the model `name`; NotFoundError (404) when no such model is served."""
        if name == self.served_model_name:
            return Lease.base(name)
        if self.registry is None:
            raise _not_found(name)
        return await self.registry.acquire(name)

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

    def card(self, name: str) -> dict[str, Any]:
        """GET /v1/models/{name}: the card, or NotFoundError like any other use of an unknown name."""
        for card in self.cards():
            if card["id"] == name:
                return card
        raise _not_found(name)

    def cards(self) -> list[dict[str, Any]]:
        """GET /v1/models entries (OpenAI shape plus vLLM's root / parent / max_model_len)."""
        cards = [self._card(self.served_model_name, self.created, self.model_path, None)]
        if self.registry is not None:
            cards += [
                self._card(e.name, int(e.loaded_at), e.path, self.served_model_name)
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
