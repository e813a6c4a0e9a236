"""When an engine counts as healthy: stored state `healthy` and a heartbeat within `stale_after_s`.

Computed at read time (no sweep to run): the stored state says what the engine last told us, the
heartbeat's age says whether it is still telling us.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import ColumnElement, and_

from control_plane.db.models import Engine, EngineState


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def cutoff(stale_after_s: float) -> dt.datetime:
    return now() - dt.timedelta(seconds=stale_after_s)


def healthy_clause(stale_after_s: float) -> ColumnElement[bool]:
    return and_(Engine.state == EngineState.HEALTHY.value, Engine.last_heartbeat >= cutoff(stale_after_s))


def effective_state(engine: Engine, stale_after_s: float) -> str:
    if engine.state != EngineState.HEALTHY.value:
        return engine.state
    beat = engine.last_heartbeat
    if beat is None or beat.replace(tzinfo=beat.tzinfo or dt.UTC) < cutoff(stale_after_s):
        return EngineState.UNHEALTHY.value
    return engine.state
