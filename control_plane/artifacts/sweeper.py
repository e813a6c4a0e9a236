"""StoreSweeper: the artifact store's objects that no blob row names (an upload killed between putting
its files and committing its version) are removed once they are older than the grace period
(`--store-gc-grace-s`), at start and every grace period after. Each sweep that removes something is one
audit event (`collect_store_orphans`, by `system:store-gc`) and counts in
`loraplane_control_store_orphans_removed_total`.
"""

from __future__ import annotations

import logging

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane import audit
from control_plane.artifacts import blobs
from control_plane.artifacts.store import ArtifactStore
from control_plane.db.session import WriteGate
from control_plane.db.transaction import transact
from control_plane.metrics import ControlPlaneMetrics
from control_plane.periodic import Periodic

logger = logging.getLogger(__name__)
ACTOR, ACTION = "system:store-gc", "collect_store_orphans"


class StoreSweeper:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], gate: WriteGate, store: ArtifactStore,
                 grace_s: float, metrics: ControlPlaneMetrics) -> None:
        self.sessions, self.gate, self.store, self.grace_s, self.metrics = sessions, gate, store, grace_s, metrics
        self._rounds = Periodic("store-gc", grace_s, self.sweep, immediately=True,
                                what="sweeping the artifact store for objects no version names")

    async def start(self) -> None:
        await self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()

    async def sweep(self) -> list[str]:
        """One walk of the store; the sha256 of the objects removed."""
        async with self.sessions() as session:
            found = await blobs.orphans(session, self.store, self.grace_s)
            removed: list[str] = []
            for sha256, size in found:
                async def collect(s: AsyncSession, sha256: str = sha256, size: int = size) -> list[str]:
                    return await blobs.collect_orphan(s, self.store, sha256, size)

                removed += await transact(session, self.gate, collect, what="collecting an orphaned store object",
                                          idempotent=True, races=True)
            if removed:
                freed = sum(size for sha256, size in found if sha256 in set(removed))
                self.metrics.store_orphans_removed.inc(len(removed))
                logger.info("artifact store: removed %d object(s) (%d bytes) that no version names", len(removed),
                            freed)
                row = audit.event(ACTOR, ACTION, self.store.safe_url, "ok",
                                  {"removed": len(removed), "bytes": freed, "grace_s": self.grace_s,
                                   "sha256": removed[:20]})
                await audit.record_alone(session, self.gate, row)
        return removed
