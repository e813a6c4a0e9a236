"""The one place where the OpenAI `model` name becomes an adapter id.

Today only the base model is served (adapter id 0). Multi-LoRA extends `resolve` with the adapter
registry (acquire → pinned id, release when the request ends) and `cards` with the loaded adapters.
An unknown name is always a 404: never a silent fallback to the base model.
"""

from __future__ import annotations

import time
from typing import Any

from shared.errors import NotFoundError

BASE_ADAPTER_ID = 0


class ModelResolver:
    def __init__(self, served_model_name: str, model_path: str, max_model_len: int) -> None:
        self.served_model_name = served_model_name
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.created = int(time.time())

    def resolve(self, name: str) -> int:
        """Adapter id serving `name`; NotFoundError (404) when no such model is served."""
        if name == self.served_model_name:
            return BASE_ADAPTER_ID
        raise NotFoundError(f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def card(self, name: str) -> dict[str, Any]:
        """GET /v1/models/{name}: the card, or NotFoundError like any other use of an unknown name."""
        self.resolve(name)
        return next(c for c in self.cards() if c["id"] == name)

    def cards(self) -> list[dict[str, Any]]:
        """GET /v1/models entries (OpenAI shape plus vLLM's root / parent / max_model_len)."""
        return [
            {
                "id": self.served_model_name,
                "object": "model",
                "created": self.created,
                "owned_by": "loraplane",
                "root": self.model_path,
                "parent": None,
                "max_model_len": self.max_model_len,
            }
        ]
