"""EngineCollector: engines with no heartbeat for `engine_gc_after_s` are removed with their placements,
as `loraplane engines remove` removes one (service.forget), checked at start and every
`engine_stale_after_s`; 0 turns it off. Each removal is one audit event (`delete_engine`, by
`system:engine-gc`) whose detail names the reason and the last heartbeat. An engine still running gets
404 on its next heartbeat and registers again.
"""

from __future__ import annotations

import datetime as dt
import logging

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane import audit
from control_plane.db.models import Engine
from control_plane.db.session import WriteGate
from control_plane.db.transaction import read, transact
from control_plane.domain.engines.health import cutoff, silent_since
from control_plane.domain.engines.service import forget
from control_plane.periodic import Periodic
from control_plane.settings import ControlPlaneSettings

logger = logging.getLogger(__name__)
ACTOR, ACTION = "system:engine-gc", "delete_engine"


class EngineCollector:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], gate: WriteGate,
                 settings: ControlPlaneSettings) -> None:
        self.sessions, self.gate, self.after_s = sessions, gate, settings.engine_gc_after_s
        self._rounds = Periodic("engine-gc", settings.engine_stale_after_s, self.collect, immediately=True,
                                what="removing engines silent for longer than engine_gc_after_s")

    async def start(self) -> None:
        if self.after_s > 0:
            await self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()

    async def collect(self) -> list[str]:
        """One round: the names of the engines removed."""
        removed: list[str] = []
        async with self.sessions() as session:
            async def silent() -> list[str]:
                beat = func.coalesce(Engine.last_heartbeat, Engine.updated_at)
                return list((await session.scalars(select(Engine.name).where(beat < cutoff(self.after_s)))).all())

            for name in await read(session, silent, "list silent engines"):
                async def remove(s: AsyncSession, name: str = name) -> tuple[bool, str | None]:
                    engine = await s.scalar(select(Engine).where(Engine.name == name).with_for_update())
                    if engine is None or not silent_since(engine, self.after_s):  # gone, or it heartbeat since
                        return False, None
                    last = _iso(engine.last_heartbeat)
                    await forget(s, engine)
                    s.add(audit.event(ACTOR, ACTION, name, "ok", {
                        "reason": f"no heartbeat for more than {self.after_s:g} s (engine_gc_after_s)",
                        "last_heartbeat": last, "engine_gc_after_s": self.after_s}))
                    return True, last

                done, last = await transact(session, self.gate, remove, what=f"removing silent engine {name!r}",
                                            idempotent=False, races=True)
                if done:
                    logger.info("engine %r removed: no heartbeat since %s", name, last)
                    removed.append(name)
        return removed


def _iso(at: dt.datetime | None) -> str | None:
    return None if at is None else at.replace(tzinfo=at.tzinfo or dt.UTC).isoformat()
