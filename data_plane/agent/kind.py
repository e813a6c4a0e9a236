"""What `loraplane agent` needs of an engine it drives: one small interface, one class per engine kind.

A kind loads a folder under a name (`inplace`: the name holds other files, replaced with the engine's
own in-place load), unloads a name, lists what the engine serves (its base model and the adapters with
the folder each was loaded from), reads its figures (queues, slots, requests and tokens by served name,
the process's start time), and says whether it is healthy. Every method is one bounded call to the
engine: a failure, a hang past the timeout or an answer that is not what the engine returns raises
EngineCallFailed with a sanitized, bounded message (shared.sanitize), never the engine's text verbatim.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from shared.errors import LoraplaneError


class EngineCallFailed(LoraplaneError):
    """The engine could not do it: unreachable, too slow, an error answer or garbage (502)."""

    status_code = 502
    error_type = "engine_error"


@dataclass(frozen=True)
class Served:
    """What the engine serves: its base model's served name, context length and folder (as the engine
    names them), and each adapter's folder by name."""

    base_model: str
    max_model_len: int | None = None
    model_path: str | None = None
    adapters: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Figures:
    """The engine's figures: the adapters with requests running or waiting (named, not counted), its
    adapter slots when it says them, requests by outcome and tokens by served name, and when its
    process started (a change: the engine restarted and lost what was loaded at run time)."""

    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    max_loras: int | None = None
    requests: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    prompt_tokens: Mapping[str, int] = field(default_factory=dict)
    generated_tokens: Mapping[str, int] = field(default_factory=dict)
    started_at: float | None = None


class EngineKind(Protocol):
    url: str  # the engine's OpenAI server, where inference goes

    async def load(self, name: str, folder: Path, inplace: bool) -> None: ...

    async def unload(self, name: str) -> bool:
        """False when the engine does not hold `name`."""
        ...

    async def listing(self) -> Served: ...

    async def stats(self) -> Figures: ...

    async def health(self) -> str | None:
        """None when the engine answers its health check, else why not (short, safe to show)."""
        ...

    async def aclose(self) -> None: ...
