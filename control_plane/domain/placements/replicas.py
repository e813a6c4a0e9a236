"""Replica rules, pure: how many engines should hold an adapter, which ones, and which to let go.

No database here: the planner (one adapter, inside an admin call) and the fleet pass (every adapter, once
per reconcile interval) read the rows into these shapes, ask, and write what the answers say.

- `ReplicaRule`: an adapter's `replicas {min, max}` (NULL columns: the control plane's defaults; max 0:
  "all") and the target demand scaling chose. desired = clamp(target or min, min, max or all), and never
  more than the healthy engines that can take it (`ceiling`).
- `EngineLoad`: what an engine can hold and holds. Capacity is its host cache (`max_cpu_loras`, which
  also holds its device-resident adapters) and its device slots; pinned adapters take device slots
  first. The rendezvous weight grows with free device slots (twice) and free host-cache room, and falls
  to a last-resort minimum where the adapter's rank exceeds the engine's `max_lora_rank` (excluded) or its
  files do not fit the engine's free cache bytes.
- `fill`: engines to add until `desired` healthy engines hold the adapter, by weighted rendezvous order.
- `releasable`: placements that may go now: those on unhealthy engines and those leaving (a rebalancing
  move), once at least `desired` healthy replicas are observed loaded; then any above `keep`, the least
  useful first (not loaded yet, then lowest in the adapter's rendezvous order), never a loaded one that
  would leave fewer than `keep` loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from control_plane.domain.placements.rendezvous import Candidate, rank

LAST_RESORT_WEIGHT = 0.05  # an engine whose cache cannot take the files: chosen only when nothing else is left


@dataclass(frozen=True)
class ReplicaDefaults:
    """`--default-min-replicas` / `--default-max-replicas` (0: all)."""

    min: int = 1
    max: int = 3


@dataclass(frozen=True)
class ReplicaRule:
    min: int
    max: int  # 0: every engine that can take it
    target: int | None  # demand scaling's choice; None: min

    @classmethod
    def of(cls, min_replicas: int | None, max_replicas: int | None, target: int | None,
           defaults: ReplicaDefaults) -> ReplicaRule:
        return cls(defaults.min if min_replicas is None else min_replicas,
                   defaults.max if max_replicas is None else max_replicas, target)

    def ceiling(self, engines: int) -> int:
        """The most replicas there may be with `engines` engines able to take the adapter."""
        return engines if self.max == 0 else min(self.max, engines)

    def wanted(self) -> int:
        """The replica count asked for, before the engines at hand bound it."""
        want = self.min if self.target is None else max(self.target, self.min)
        return want if self.max == 0 else min(want, self.max)

    def desired(self, engines: int) -> int:
        return min(self.wanted(), self.ceiling(engines))


@dataclass
class EngineLoad:
    """One engine as placement sees it; `pinned` / `loaded` count the adapters it is desired to hold."""

    id: int
    name: str
    healthy: bool
    slots: int = 0  # device slots (slots_total)
    host_slots: int = 0  # host-cache slots (max_cpu_loras)
    cache_bytes_free: int | None = None  # free room of its artifact cache, when it says
    max_lora_rank: int = 0  # 0: not said
    pinned: int = 0
    loaded: int = 0

    @property
    def capacity(self) -> int:
        return max(self.host_slots, self.slots, 1)

    @property
    def free(self) -> int:
        """Capacity left (negative: more placed than it keeps without reading from disk)."""
        return self.capacity - self.pinned - self.loaded

    def takes(self, rank: int) -> bool:
        return self.max_lora_rank <= 0 or rank <= self.max_lora_rank

    def weight(self, size_bytes: int = 0) -> float:
        if self.cache_bytes_free is not None and self.cache_bytes_free < size_bytes:
            return LAST_RESORT_WEIGHT
        device_free = self.slots - self.pinned - self.loaded  # pinned ones take the device slots first
        return 1.0 + 2.0 * max(device_free, 0) + max(self.free, 0)

    def hold(self, pinned: bool, count: int = 1) -> None:
        if pinned:
            self.pinned += count
        else:
            self.loaded += count


@dataclass(frozen=True)
class Holder:
    """A placement desired held (loaded or pinned) for some version of the adapter."""

    placement_id: int
    engine_id: int
    pinned: bool
    loaded: bool  # observed loaded
    leaving: bool = False  # a rebalancing move's source: released once the replacement is loaded


@dataclass
class AdapterPlacement:
    """One adapter as placement sees it."""

    id: int
    name: str
    rule: ReplicaRule
    matching: Sequence[int]  # ids of the engines serving its base model (any health)
    holders: list[Holder] = field(default_factory=list)
    size_bytes: int = 0
    rank: int = 0

    @property
    def pinned(self) -> bool:
        """New replicas of a pinned adapter are pinned too."""
        return any(h.pinned for h in self.holders)

    def able(self, engines: dict[int, EngineLoad]) -> list[EngineLoad]:
        """Healthy engines of its base model that can load its rank."""
        return [engines[i] for i in self.matching if i in engines and engines[i].healthy and engines[i].takes(self.rank)]

    def serving(self, engines: dict[int, EngineLoad]) -> dict[int, list[Holder]]:
        """Engine id -> holders, for healthy engines and placements that are not leaving."""
        out: dict[int, list[Holder]] = {}
        for h in self.holders:
            engine = engines.get(h.engine_id)
            if engine is not None and engine.healthy and not h.leaving:
                out.setdefault(h.engine_id, []).append(h)
        return out

    def order(self, loads: Iterable[EngineLoad]) -> list[int]:
        """Engine ids, this adapter's most preferred first (weighted rendezvous)."""
        loads = list(loads)
        by_name = {e.name: e.id for e in loads}
        return [by_name[n] for n in rank(self.name, [Candidate(e.name, e.weight(self.size_bytes)) for e in loads])]


def fill(adapter: AdapterPlacement, engines: dict[int, EngineLoad], desired: int) -> list[int]:
    """Engine ids to add so that `desired` healthy engines hold the adapter (their loads are counted)."""
    serving = adapter.serving(engines)
    holding = {h.engine_id for h in adapter.holders}
    need = desired - len(serving)
    if need <= 0:
        return []
    free = [e for e in adapter.able(engines) if e.id not in holding]
    chosen = adapter.order(free)[:need]
    for engine_id in chosen:
        engines[engine_id].hold(adapter.pinned)
    return chosen


def loaded_replicas(adapter: AdapterPlacement, engines: dict[int, EngineLoad]) -> int:
    return sum(any(h.loaded for h in hs) for hs in adapter.serving(engines).values())


def releasable(adapter: AdapterPlacement, engines: dict[int, EngineLoad], desired: int, keep: int) -> list[int]:
    """Placement ids to desire absent now (see the module doc); the engines' loads are updated."""
    out: list[int] = []
    if loaded_replicas(adapter, engines) >= max(desired, 1):
        out = [h.placement_id for h in adapter.holders
               if h.leaving or h.engine_id not in engines or not engines[h.engine_id].healthy]
    serving = adapter.serving(engines)
    surplus = len(serving) - keep
    if surplus > 0:
        ranked = adapter.order(engines[i] for i in serving)
        # the least useful first: not loaded yet, then lowest in the adapter's order
        worst = sorted(serving, key=lambda i: (any(h.loaded for h in serving[i]), -ranked.index(i)))
        loaded = loaded_replicas(adapter, engines)
        for engine_id in worst:
            if surplus == 0:
                break
            is_loaded = any(h.loaded for h in serving[engine_id])
            if is_loaded and loaded - 1 < keep:
                continue
            loaded -= is_loaded
            surplus -= 1
            out.extend(h.placement_id for h in serving[engine_id])
            engines[engine_id].hold(adapter.pinned, -1)
    return out  # leaving and unhealthy placements were never counted in the loads
