"""Periodic: one asyncio task that runs an async callable every `every_s` seconds until stopped.

The control plane's background rounds (the store sweep, the stats history, the engine collection) run
through it. A round that raises is logged with `what` and the loop goes on; `stop` cancels the task and
waits for it, so nothing runs after it returns. `immediately` runs the first round at `start`, otherwise
the first round comes one interval later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)


class Periodic:
    def __init__(self, name: str, every_s: float, work: Callable[[], Awaitable[object]], *, what: str,
                 immediately: bool = False) -> None:
        self.name, self.every_s, self.work, self.what, self.immediately = name, every_s, work, what, immediately
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name=self.name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _loop(self) -> None:
        if not self.immediately:
            await asyncio.sleep(self.every_s)
        while True:
            try:
                await self.work()
            except Exception:  # logged, and the next round comes as planned
                logger.exception("%s failed", self.what)
            await asyncio.sleep(self.every_s)
