"""KeyedLock: one asyncio.Lock per key, created on demand and forgotten once nobody holds or waits for it
(a registry that sees thousands of adapter names over its life must not keep a lock for each)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class KeyedLock:
    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # key -> (lock, holders + waiters)

    def __len__(self) -> int:
        return len(self._locks)

    @asynccontextmanager
    async def __call__(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)
