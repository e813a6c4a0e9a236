"""HostCache: which adapters keep validated weights in host memory, least recently used first.

At most `capacity` entries hold host weights. Over capacity, the least recently used entry that is
neither pinned nor in use loses its host copy (residency → disk); if every entry is pinned or in
use, the cache stays over capacity rather than drop weights a request or a pin still needs.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from data_plane.adapters.entry import AdapterEntry

logger = logging.getLogger(__name__)


class HostCache:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("host cache capacity must be at least 1")
        self.capacity = capacity
        self._lru: OrderedDict[AdapterEntry, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, entry: AdapterEntry) -> bool:
        return entry in self._lru

    def put(self, entry: AdapterEntry) -> list[AdapterEntry]:
        """Entry now holds host weights (most recently used); returns the entries that lost theirs."""
        assert entry.weights is not None
        self._lru[entry] = None
        self._lru.move_to_end(entry)
        return self.shrink()

    def touch(self, entry: AdapterEntry) -> None:
        if entry in self._lru:
            self._lru.move_to_end(entry)

    def remove(self, entry: AdapterEntry) -> None:
        """Forget the entry and drop its host copy (unload)."""
        self._lru.pop(entry, None)
        entry.weights = None

    def shrink(self) -> list[AdapterEntry]:
        dropped = []
        for entry in list(self._lru):
            if len(self._lru) <= self.capacity:
                break
            if entry.pinned or entry.in_flight > 0:
                continue
            del self._lru[entry]
            entry.weights = None  # requests that hold a Lease keep their own reference
            dropped.append(entry)
            logger.info("host cache: dropped adapter %s (id %d) to disk", entry.name, entry.adapter_id)
        return dropped
