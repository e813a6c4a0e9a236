"""LoRARegistry: adapter names ↔ integer ids, and the load / acquire / unload lifecycle.

It lives on the event loop (no thread locks). Loading and unloading one name are serialized by that
name's asyncio.Lock; `acquire` takes no lock, so requests never wait behind an admin call. Files
are read and validated off the loop (data_plane/background.py, at low priority; the engine's loader does
it in an adapter reader process, loading/reader_process.py); the engine is only told about pins and
removals — for normal requests it gets the weights on the Request and copies them into a slot itself.

Every load that brings new content gets a fresh id (ids are never reused), so the engine's slot and
prefix-cache state of an old version can never be mistaken for the new one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from typing import Any, Protocol

from data_plane.adapters.entry import AdapterEntry, AdapterState, Lease, Residency
from data_plane.adapters.host_cache import HostCache
from data_plane.adapters.keyed_lock import KeyedLock
from data_plane.adapters.stats import LoRAStatsSource
from data_plane.background import read_off_loop
from data_plane.lora.errors import LoRAConflictError, LoRANotFoundError
from data_plane.lora.weights import LoRAAdapterWeights
from shared.errors import InvalidRequestError
from shared.names import name_problem

logger = logging.getLogger(__name__)

ABORT_GRACE_S = 10.0  # after aborting, how long to wait for the aborted requests to let go


class LoRAEngine(Protocol):
    """The part of the engine (data_plane.engine.protocol.EngineProtocol) the registry drives."""

    async def pin_lora(self, adapter_id: int, weights: LoRAAdapterWeights) -> None: ...
    async def unpin_lora(self, adapter_id: int) -> None: ...
    async def remove_lora(self, adapter_id: int) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def stats(self) -> LoRAStatsSource: ...


Loader = Callable[[str], LoRAAdapterWeights]  # path -> validated weights; raises LoRAAdapterError


class LoRARegistry:
    def __init__(
        self,
        engine: LoRAEngine,
        loader: Loader,
        *,
        base_name: str,
        max_cpu_loras: int,
        default_drain_timeout_s: float = 30.0,
        on_unloaded: Callable[[str], None] | None = None,  # a name has no version left (stats cleanup)
    ) -> None:
        self._engine = engine
        self._loader = loader
        self.base_name = base_name
        self.default_drain_timeout_s = default_drain_timeout_s
        self._on_unloaded = on_unloaded
        self._ids = itertools.count(1)
        self._active: dict[str, AdapterEntry] = {}  # name -> the READY version new requests get
        self._by_id: dict[int, AdapterEntry] = {}  # every version still known (ready or draining)
        self._loading: dict[str, str] = {}  # name -> path while its files are read
        self._generations: dict[str, tuple[str, int]] = {}  # name -> (last sha256, load generation)
        self._host = HostCache(max_cpu_loras)
        self._name_lock = KeyedLock()  # serializes load/unload per name
        self._tasks: set[asyncio.Task[Any]] = set()
        # called right before the engine forgets an adapter (its per-id counters go with it): the
        # metrics take their last reading here, so loads between two scrapes are never lost
        self.before_remove: Callable[[], None] | None = None

    # ---- queries -------------------------------------------------------------------------------
    def entries(self) -> Iterator[AdapterEntry]:
        return iter(list(self._by_id.values()))

    def ready(self) -> list[AdapterEntry]:
        return list(self._active.values())

    def loading(self) -> dict[str, str]:
        return dict(self._loading)

    def name_of(self, adapter_id: int) -> str | None:
        entry = self._by_id.get(adapter_id)
        return entry.name if entry is not None else None

    def is_loaded(self, name: str) -> bool:
        return name in self._active or any(e.name == name for e in self._by_id.values())

    def residency(self, entry: AdapterEntry) -> Residency:
        if entry.pinned:  # pin_lora copied it into a slot (the engine's stats may lag one step)
            return Residency.DEVICE
        adapter = self._engine.stats().lora.adapters.get(entry.adapter_id)
        if adapter is not None and adapter.slot is not None:
            return Residency.DEVICE
        return Residency.HOST if entry.weights is not None else Residency.DISK

    # ---- load ----------------------------------------------------------------------------------
    async def load(
        self, name: str, path: str, *, pinned: bool = False, load_inplace: bool = False,
        expected_sha256: str | None = None, version: int | None = None,
    ) -> dict[str, Any]:
        """Load (or re-declare) `name` from `path`; returns the load reply body. `expected_sha256`: the
        manifest digest the caller recorded for this version; files that differ are refused, nothing loaded.
        `version`: the control plane registry's number of this version, listed as the entry's `version`."""
        _check_name(name, self.base_name)
        async with self._name_lock(name):
            self._loading[name] = path
            try:
                weights = await read_off_loop(self._loader, path)
            finally:
                del self._loading[name]
            digest = weights.description.sha256
            if expected_sha256 is not None and digest != expected_sha256:
                raise LoRAConflictError(
                    f"adapter_config.json or its weights changed since the version was recorded: sha256 "
                    f"{expected_sha256[:16]}… expected, {digest[:16]}… found; nothing was loaded",
                    param="expected_sha256", code="sha256_mismatch")
            current = self._active.get(name)
            if current is not None and current.description.sha256 == digest:
                await self._redeclare(current, weights, pinned)
                if version is not None:
                    current.version = version
                return current.info(self.residency(current))
            if current is not None and not load_inplace:
                raise LoRAConflictError(
                    f"adapter {name} is already loaded with different content (sha256 "
                    f"{current.description.sha256[:12]}…, new files {digest[:12]}…); pass load_inplace=true to "
                    "replace it",
                    param="lora_name",
                )
            entry = AdapterEntry.from_weights(name, next(self._ids), self._next_generation(name, weights), weights,
                                              pinned, version)
            if pinned:
                await self._pin_replacing(entry, current)
            self._generations[name] = (entry.description.sha256, entry.load_generation)
            self._by_id[entry.adapter_id] = entry
            self._active[name] = entry
            self._host.put(entry)
            if current is not None:  # load_inplace: new requests get the new id from here on
                self._start_retire(current, self.default_drain_timeout_s)
            logger.info("loaded adapter %s (%s, load generation %d) as id %d from %s", name,
                        "not from the registry" if version is None else f"version {version}",
                        entry.load_generation, entry.adapter_id, path)
            return entry.info(self.residency(entry))

    async def _redeclare(self, entry: AdapterEntry, weights: LoRAAdapterWeights, pinned: bool) -> None:
        """Same content again: idempotent; `pinned` is the desired state, and the host copy is refreshed."""
        if pinned and not entry.pinned:
            await self._engine.pin_lora(entry.adapter_id, weights)
        elif entry.pinned and not pinned:
            await self._engine.unpin_lora(entry.adapter_id)
        entry.pinned = pinned
        entry.path = weights.path  # same content, maybe another copy: re-reads go to the latest one named
        if entry.weights is None:
            entry.weights = weights
        self._host.put(entry)

    async def _pin_replacing(self, entry: AdapterEntry, old: AdapterEntry | None) -> None:
        """Pin the new version; a pinned old version gives up its pin first so a full pool still fits."""
        assert entry.weights is not None
        if old is not None and old.pinned:
            await self._engine.unpin_lora(old.adapter_id)
            old.pinned = False
        try:
            await self._engine.pin_lora(entry.adapter_id, entry.weights)
        except BaseException:
            if old is not None and old.weights is not None and old.state is AdapterState.READY:
                await self._engine.pin_lora(old.adapter_id, old.weights)
                old.pinned = True
            raise

    def _next_generation(self, name: str, weights: LoRAAdapterWeights) -> int:
        last = self._generations.get(name)
        if last is None:
            return 1
        return last[1] if last[0] == weights.description.sha256 else last[1] + 1

    # ---- requests ------------------------------------------------------------------------------
    async def acquire(self, name: str) -> Lease:
        """A Lease on `name` (the base model's name gives a no-op base lease); 404 when not served. A
        request for a name whose load is in progress waits for it (and is 404 if the load fails)."""
        if name == self.base_name:
            return Lease.base(name)
        entry = self._active.get(name)
        if entry is None and name in self._loading:
            # its files are being read (a load call, or a reconcile after a restart): wait for that
            # load's outcome instead of refusing a name that is about to be served
            async with self._name_lock(name):
                entry = self._active.get(name)
        if entry is None:
            if any(e.name == name for e in self._by_id.values()):
                raise _not_found(f"adapter {name} is being unloaded")
            raise _not_found(f"The model `{name}` does not exist.")
        entry.in_flight += 1
        entry.idle.clear()
        entry.last_used_at = time.time()
        self._host.touch(entry)
        lease = Lease(name, entry, self._release)
        if entry.weights is None:
            try:
                await self._reread(entry)
            except BaseException:
                lease.release()
                raise
            lease.weights = entry.weights
        return lease

    async def _reread(self, entry: AdapterEntry) -> None:
        """Bring a dropped host copy back from disk; refuse if the files changed since the load."""
        async with entry.reread_lock:
            if entry.weights is not None:  # another request re-read it meanwhile
                return
            weights = await read_off_loop(self._loader, entry.path)
            was, now = entry.description.sha256, weights.description.sha256
            if now != was:
                raise LoRAConflictError(
                    f"adapter {entry.name}: files changed since load; reload with load_inplace "
                    f"(sha256 {was[:12]}… at load, {now[:12]}… now)",
                    param="model",
                )
            entry.weights = weights
            if entry.state is not AdapterState.DRAINING:
                self._host.put(entry)

    def _release(self, lease: Lease) -> None:
        entry = lease.entry
        assert entry is not None
        entry.in_flight -= 1
        if lease.request_id is not None:
            entry.request_ids.discard(lease.request_id)
        entry.last_used_at = time.time()
        if entry.in_flight == 0:
            entry.idle.set()
            self._host.shrink()  # it may have been kept over capacity only because it was in use

    # ---- unload --------------------------------------------------------------------------------
    async def unload(self, name: str, drain_timeout_s: float | None = None) -> dict[str, Any]:
        """Stop admitting `name`, drain (then abort) its requests, free its slot and host copy."""
        timeout = self.default_drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        if timeout < 0:
            raise InvalidRequestError("drain_timeout_s must be >= 0", param="drain_timeout_s")
        async with self._name_lock(name):
            entry = self._active.pop(name, None)
            if entry is None:
                raise LoRANotFoundError(f"adapter {name} is not loaded", param="lora_name")
            task = self._start_retire(entry, timeout)
            # shielded: a caller that goes away must not leave the adapter half-unloaded
            drained, aborted = await asyncio.shield(task)
        return {"name": name, "drained": drained, "aborted": aborted}

    def _start_retire(self, entry: AdapterEntry, timeout: float) -> asyncio.Task[tuple[bool, int]]:
        entry.state = AdapterState.DRAINING
        task = asyncio.ensure_future(self._retire(entry, timeout))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _retire(self, entry: AdapterEntry, timeout: float) -> tuple[bool, int]:
        drained, aborted = True, 0
        try:
            drained, aborted = await self._drain(entry, timeout)
        finally:
            if self.before_remove is not None:
                with suppress(Exception):  # metrics must never keep the slot from being freed
                    self.before_remove()
            try:
                await self._engine.remove_lora(entry.adapter_id)  # frees the slot (vLLM #42633)
            except Exception:
                logger.exception("engine failed to remove adapter %s (id %d)", entry.name, entry.adapter_id)
            self._by_id.pop(entry.adapter_id, None)
            self._host.remove(entry)
            logger.info("unloaded adapter %s (id %d): drained=%s aborted=%d", entry.name, entry.adapter_id, drained, aborted)
            if self._on_unloaded is not None and not self.is_loaded(entry.name):
                self._on_unloaded(entry.name)
        return drained, aborted

    async def _drain(self, entry: AdapterEntry, timeout: float) -> tuple[bool, int]:
        if not entry.idle.is_set():  # (wait_for with timeout 0 would time out even on a set event)
            with suppress(TimeoutError):
                await asyncio.wait_for(entry.idle.wait(), timeout)
        aborted = entry.in_flight
        if aborted == 0:
            return True, 0
        entry.abort_error = LoRANotFoundError(
            f"adapter {entry.name} was unloaded: the request was aborted after the drain timeout of {timeout:g}s",
            param="model",
            code="adapter_unloaded",
        )
        for request_id in list(entry.request_ids):
            self._engine.abort(request_id)
        try:
            await asyncio.wait_for(entry.idle.wait(), ABORT_GRACE_S)
        except TimeoutError:
            # the engine has no sequence of it any more (aborts precede the removal); only API-side
            # holders (e.g. a stalled client socket) remain, and their release is harmless later
            logger.warning("adapter %s: %d aborted requests still hold it", entry.name, entry.in_flight)
        return False, aborted

    async def close(self) -> None:
        """Cancel background drains (server shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _not_found(message: str) -> LoRANotFoundError:
    return LoRANotFoundError(message, param="model", code="model_not_found")


def _check_name(name: str, base_name: str) -> None:
    """The shared name rule (no NUL, bidi controls, newlines or `..` segments), and not the base's name:
    requests for that name get the base model, so such an adapter could never be served."""
    problem = name_problem(name)
    if problem is not None:
        shown = repr(name[:64]) + ("…" if len(name) > 64 else "")  # repr: control characters escaped
        raise InvalidRequestError(f"lora_name {shown} is not a valid adapter name: {problem}", param="lora_name")
    if name == base_name:
        raise InvalidRequestError(
            f"lora_name {name!r} is the base model's name; requests for it are served by the base model, "
            "so choose another adapter name", param="lora_name")
