"""Which adapters' host copies the engine core holds, as the API process sees it.

A request for an adapter the core holds no copy of hands one over first (adapters/loading/transfer.py:
shared memory, sent before the request on the same socket, so the core always has it in time). The
core keeps at most `capacity` copies (--max-cpu-loras, like the registry's host cache): past that,
the least recently used copy of an adapter with no request in flight here is dropped there. A device
slot keeps its own copy of the weights, so dropping a host copy never touches a slot; if that adapter
is needed again later, its next request hands a copy over again.

It stays in engine/core, beside the client that calls it: it is the core's side of the hand-over and
sends the core's messages (ShipAdapter, ForgetAdapter); the layout it sends is adapters/loading/transfer.py's.

The weights handed over are kept here until the core is told to drop them: their shared file lives as
long as they do (data_plane/adapters/loading/shared_tensors.py), and the core maps it only when it reads
the hand-over, maybe after the registry dropped its own reference. Keeping them costs no memory: the core's
mapping holds the same pages.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable

from data_plane.adapters.loading.transfer import share_adapter
from data_plane.engine.core.messages import ForgetAdapter, ShipAdapter
from data_plane.lora.weights import LoRAAdapterWeights


class HostCopies:
    def __init__(self, capacity: int, send: Callable[[object], None]) -> None:
        self.capacity = capacity
        self._send = send
        # adapter id -> the weights the core holds (maps) of it, oldest use first
        self._held: OrderedDict[int, LoRAAdapterWeights] = OrderedDict()
        self._in_flight: Counter[int] = Counter()

    def held(self) -> list[int]:
        return list(self._held)

    def acquire(self, adapter_id: int, weights: LoRAAdapterWeights | None) -> None:
        """A request of this adapter is about to be sent: make sure the core holds its weights."""
        self._in_flight[adapter_id] += 1
        self.ensure(adapter_id, weights)

    def release(self, adapter_id: int) -> None:
        self._in_flight[adapter_id] -= 1
        if self._in_flight[adapter_id] <= 0:
            del self._in_flight[adapter_id]

    def ensure(self, adapter_id: int, weights: LoRAAdapterWeights | None) -> None:
        if adapter_id in self._held:
            self._held.move_to_end(adapter_id)
            return
        if weights is None:  # nothing to hand over: the core refuses the request itself (400)
            return
        self._send(ShipAdapter(adapter_id, share_adapter(weights)))  # its layout only: no copy on the loop
        self._held[adapter_id] = weights
        self._trim(keep=adapter_id)

    def forget(self, adapter_id: int) -> None:
        """The core dropped its copy (remove_lora)."""
        self._held.pop(adapter_id, None)

    def _trim(self, keep: int) -> None:
        idle = [a for a in self._held if a not in self._in_flight and a != keep]
        while len(self._held) > self.capacity and idle:
            victim = idle.pop(0)
            del self._held[victim]
            self._send(ForgetAdapter(victim))
