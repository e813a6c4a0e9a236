"""One loaded adapter version as the registry tracks it, and the Lease a request holds on it.

An entry is one *version*: reloading changed content under the same name makes a new entry with a
fresh adapter id, while the old entry drains. A Lease is what a request holds from `acquire` until
it ends; it carries everything the Request needs (id, cache namespace, host weights), so the
serving layer never reaches back into the registry.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from data_plane.lora.weights import LoRAAdapterWeights
from shared.engine_admin import AdapterDescription
from shared.errors import LoraplaneError

BASE_ADAPTER_ID = 0


class AdapterState(enum.StrEnum):
    LOADING = "loading"  # files being read and validated (only ever shown in the list)
    READY = "ready"  # serves new requests
    DRAINING = "draining"  # refuses new requests; waits for its in-flight ones, then is dropped


class Residency(enum.StrEnum):
    DEVICE = "device"  # in an engine slot
    HOST = "host"  # validated weights in the host cache
    DISK = "disk"  # host copy dropped by the LRU: re-read on the next request


@dataclass(eq=False)  # identity semantics: entries are keys of the host cache and id maps
class AdapterEntry:
    name: str
    adapter_id: int
    load_generation: int  # how many times this name got new content on this engine
    path: str  # where its files are re-read from
    description: AdapterDescription
    cache_namespace: int
    pinned: bool
    weights: LoRAAdapterWeights | None  # host copy; None once the host cache dropped it
    state: AdapterState = AdapterState.READY
    loaded_at: float = field(default_factory=time.time)
    last_used_at: float | None = None
    in_flight: int = 0
    request_ids: set[str] = field(default_factory=set)  # engine requests to abort if the drain times out
    abort_error: LoraplaneError | None = None  # set when its requests were aborted: they report this
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while in_flight == 0
    reread_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one disk re-read at a time
    version: int | None = None  # the control plane registry's version number, when it sent the load

    def __post_init__(self) -> None:
        self.idle.set()

    @classmethod
    def from_weights(
        cls, name: str, adapter_id: int, load_generation: int, weights: LoRAAdapterWeights, pinned: bool,
        version: int | None = None,
    ) -> AdapterEntry:
        return cls(
            name=name,
            adapter_id=adapter_id,
            load_generation=load_generation,
            version=version,
            path=weights.path,
            description=weights.description,
            cache_namespace=weights.cache_namespace,
            pinned=pinned,
            weights=weights,
        )

    def info(self, residency: Residency) -> dict[str, Any]:
        """The body of a load reply (vLLM-style field names; shared.engine_admin.LoadedAdapter)."""
        return {
            **msgspec.structs.asdict(self.description),
            "name": self.name,
            "id": self.adapter_id,
            "version": self.version,
            "load_generation": self.load_generation,
            "residency": str(residency),
        }


class Lease:
    """A request's hold on an adapter: counted in-flight until `release()` (idempotent)."""

    def __init__(
        self,
        name: str,
        entry: AdapterEntry | None,
        on_release: Callable[[Lease], None] | None = None,
    ) -> None:
        self.name = name
        self.entry = entry  # None for the base model
        self.adapter_id = entry.adapter_id if entry else BASE_ADAPTER_ID
        self.cache_namespace = entry.cache_namespace if entry else 0  # base keeps seed 0
        self.weights: LoRAAdapterWeights | None = entry.weights if entry else None
        self.request_id: str | None = None
        self._on_release = on_release
        self.released = False

    @classmethod
    def base(cls, name: str) -> Lease:
        return cls(name, None)

    def bind(self, request_id: str) -> None:
        """Name the engine request this lease serves, so an unload that times out can abort it."""
        self.request_id = request_id
        if self.entry is not None and not self.released:
            self.entry.request_ids.add(request_id)

    @property
    def abort_error(self) -> LoraplaneError | None:
        """Set once an unload aborted this adapter's requests; the request must end with it."""
        return self.entry.abort_error if self.entry is not None else None

    def check_admissible(self) -> None:
        """Called right before the engine gets the request: an aborted adapter must not start one."""
        if self.abort_error is not None:
            raise self.abort_error

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if self._on_release is not None:
            self._on_release(self)
