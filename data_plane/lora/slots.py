"""Device slots: which adapters are resident for compute, loading into and evicting from them.

Runs on the engine thread only. An adapter gets a slot when the scheduler admits one of its
sequences. To make room, the slot evicted is one whose adapter is neither pinned nor busy (used by a
running sequence or one admitted this step), and of those the coldest: every admitted sequence is a
use (`use`), and uses are counted with a half-life of HEAT_HALF_LIFE uses of any adapter, so

    heat(a) = sum over a's uses u of 2 ** -((uses now - uses at u) / HEAT_HALF_LIFE)
    victim  = min over evictable a of (heat(a), uses at a's last use)

A hot adapter that is idle for a moment keeps its slot against one that came once (plain LRU would
evict it and load it back a few steps later); one that stops being used cools down within a few
half-lives, and ties (a slot loaded but never used) go to the least recently used. Heat outlives an
eviction (an adapter that comes back is as hot as its uses say) and ends with `remove`.

Writing a slot is the only LoRA work on the engine loop: reading and validating files happened before
(see peft_loader.py), and the slot's image (padded, cast, on the device: slot_pool.py) is made by
`prepare`, which any thread may call as soon as a request brings the weights, so that the step that
admits the request copies one row into the slot pool; while the engine serves, by the pool's image
thread (`prepare_soon`), and the scheduler loads no adapter whose image is still being made.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from data_plane.lora.errors import LoRAConflictError
from data_plane.lora.layers import LinearWithLoRA
from data_plane.lora.slot_pool import SlotPool
from data_plane.lora.weights import LoRAAdapterWeights

HEAT_HALF_LIFE = 32.0  # uses (admitted sequences of any adapter)


@dataclass
class AdapterEngineStats:
    slot: int | None = None
    pinned: bool = False
    running: int = 0
    waiting: int = 0
    loads: int = 0
    evictions: int = 0
    load_seconds_total: float = 0.0
    last_load_seconds: float | None = None


@dataclass
class LoRAEngineStats:
    slots_total: int
    slots_used: int
    adapters: dict[int, AdapterEngineStats]


class LoRASlotManager:
    def __init__(self, layers: list[list[LinearWithLoRA]], max_loras: int) -> None:
        self.layers = layers  # per decoder layer, its LoRA-wrapped linears
        self.max_loras = max_loras
        # every layer's slots in one tensor; as many adapter images kept as there are slots
        self.pool = SlotPool(layers, max_loras, kept_images=max_loras)
        # tensor parallel: rank 0 sends every slot write to the other ranks first (engine/tp_group.py)
        self.mirror: Callable[[int, LoRAAdapterWeights | None], None] | None = None
        self.slot_owner: list[int | None] = [None] * max_loras  # slot -> adapter id
        self.slot_rank: list[int] = [0] * max_loras  # rank of the adapter in each slot (0 = empty)
        self.slot_of: dict[int, int] = {}  # adapter id -> slot
        self.digest_of: dict[int, str] = {}  # adapter id -> sha256 of the weights it was loaded with
        self.uses = 0  # sequences admitted with any adapter: the clock heat decays by
        self.heat: dict[int, tuple[float, int]] = {}  # adapter id -> (heat, self.uses at its last use)
        self.pinned: set[int] = set()
        self.stats: dict[int, AdapterEngineStats] = {}

    def slot(self, adapter_id: int) -> int:
        return self.slot_of[adapter_id]

    def is_resident(self, adapter_id: int) -> bool:
        return adapter_id in self.slot_of

    def use(self, adapter_id: int) -> None:
        """A sequence of this (resident) adapter was admitted: it heats up."""
        self.uses += 1
        self.heat[adapter_id] = (self._heat(adapter_id)[0] + 1.0, self.uses)

    def _heat(self, adapter_id: int) -> tuple[float, int]:
        """(heat now, uses at the last use): the eviction order, coldest first."""
        heat, at = self.heat.get(adapter_id, (0.0, 0))
        return heat * 0.5 ** ((self.uses - at) / HEAT_HALF_LIFE), at

    def prepare(self, weights: LoRAAdapterWeights) -> None:
        """Make the adapter's slot image ahead of its load (thread-safe; the load copies it in one go)."""
        self.pool.prepare(weights)

    def prepare_soon(self, weights: LoRAAdapterWeights) -> None:
        """Have the pool's image thread make the slot image, paced (the engine is serving meanwhile)."""
        self.pool.prepare_soon(weights)

    def image_pending(self, weights: LoRAAdapterWeights) -> bool:
        """Whether the image thread is still making the adapter's slot image (its load would wait for it)."""
        return self.pool.is_pending(weights)

    def is_pinned(self, adapter_id: int) -> bool:
        return adapter_id in self.pinned

    def can_load(self, busy: set[int]) -> bool:
        """Whether a load now would find a slot: a free one, or one whose adapter is neither pinned nor busy."""
        return None in self.slot_owner or any(a not in self.pinned and a not in busy for a in self.slot_of)

    def ensure_resident(self, adapter_id: int, weights: LoRAAdapterWeights, busy: set[int]) -> bool:
        """Make the adapter resident; False when every slot holds a pinned or busy adapter (wait)."""
        if adapter_id in self.slot_of:
            return True
        slot = self._free_or_evictable_slot(busy)
        if slot is None:
            return False
        self._load(slot, adapter_id, weights)
        return True

    def pin(self, adapter_id: int, weights: LoRAAdapterWeights, busy: set[int]) -> None:
        if not self.ensure_resident(adapter_id, weights, busy):
            raise LoRAConflictError(
                f"Every one of the {self.max_loras} LoRA slots holds a pinned or busy adapter; "
                "unpin or unload one, or start the engine with a larger --max-loras."
            )
        self.pinned.add(adapter_id)
        self._stats(adapter_id).pinned = True

    def unpin(self, adapter_id: int) -> None:
        self.pinned.discard(adapter_id)
        self._stats(adapter_id).pinned = False

    def remove(self, adapter_id: int) -> None:
        """Forget the adapter: free its slot (zeroed, so nothing stale can ever be computed)."""
        self.pinned.discard(adapter_id)
        slot = self.slot_of.pop(adapter_id, None)
        if slot is not None:
            self.write_slot(slot, None)
            self.slot_owner[slot] = None
        self.heat.pop(adapter_id, None)
        self.stats.pop(adapter_id, None)
        digest = self.digest_of.pop(adapter_id, None)
        if digest is not None and digest not in self.digest_of.values():
            self.pool.forget(digest)

    def snapshot(self, running: dict[int, int], waiting: dict[int, int]) -> LoRAEngineStats:
        adapters = {}
        for adapter_id in set(self.stats) | set(running) | set(waiting):
            s = self._stats(adapter_id)
            adapters[adapter_id] = AdapterEngineStats(
                slot=self.slot_of.get(adapter_id), pinned=adapter_id in self.pinned,
                running=running.get(adapter_id, 0), waiting=waiting.get(adapter_id, 0),
                loads=s.loads, evictions=s.evictions,
                load_seconds_total=s.load_seconds_total, last_load_seconds=s.last_load_seconds,
            )
        return LoRAEngineStats(self.max_loras, len(self.slot_of), adapters)

    # ---- internals -----------------------------------------------------------------------------
    def _stats(self, adapter_id: int) -> AdapterEngineStats:
        return self.stats.setdefault(adapter_id, AdapterEngineStats())

    def _free_or_evictable_slot(self, busy: set[int]) -> int | None:
        if None in self.slot_owner:
            return self.slot_owner.index(None)
        candidates = [a for a in self.slot_of if a not in self.pinned and a not in busy]
        if not candidates:
            return None
        victim = min(candidates, key=self._heat)
        slot = self.slot_of.pop(victim)
        self.slot_owner[slot] = None
        self._stats(victim).evictions += 1
        return slot

    def _load(self, slot: int, adapter_id: int, weights: LoRAAdapterWeights) -> None:
        start = time.perf_counter()
        self.write_slot(slot, weights)
        self.slot_owner[slot] = adapter_id
        self.slot_of[adapter_id] = slot
        self.digest_of[adapter_id] = weights.description.sha256
        stats = self._stats(adapter_id)
        stats.loads += 1
        stats.last_load_seconds = time.perf_counter() - start
        stats.load_seconds_total += stats.last_load_seconds

    def write_slot(self, slot: int, weights: LoRAAdapterWeights | None) -> None:
        """Copy an adapter (None: zeros) into one slot of every LoRA layer, on every rank."""
        if self.mirror is not None:
            self.mirror(slot, weights)
        self.pool.write(slot, weights)
        self.slot_rank[slot] = weights.description.rank if weights is not None else 0
