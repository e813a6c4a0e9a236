"""When an engine counts as healthy: stored state `healthy` and a heartbeat within `stale_after_s`.

Computed at read time (no sweep to run): the stored state says what the engine last told us, the
heartbeat's age says whether it is still telling us. An engine silent for longer than `stale_after_s`
reads as `stale`, whatever it last said (a drained engine that stopped included); past the collector's
`engine_gc_after_s` it is removed (domain/engines/collector.py).
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import ColumnElement, and_

from control_plane.db.models import Engine, EngineState

STALE = "stale"  # read-time only: never stored


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def cutoff(stale_after_s: float) -> dt.datetime:
    return now() - dt.timedelta(seconds=stale_after_s)


def healthy_clause(stale_after_s: float) -> ColumnElement[bool]:
    return and_(Engine.state == EngineState.HEALTHY.value, Engine.last_heartbeat >= cutoff(stale_after_s))


def silent_since(engine: Engine, seconds: float) -> bool:
    """No heartbeat within the last `seconds` (never one counts as none since it was recorded)."""
    beat = engine.last_heartbeat or engine.updated_at
    return beat is None or beat.replace(tzinfo=beat.tzinfo or dt.UTC) < cutoff(seconds)


def effective_state(engine: Engine, stale_after_s: float) -> str:
    """The stored state (healthy | unhealthy | draining), or `stale` once its heartbeats stopped."""
    return STALE if silent_since(engine, stale_after_s) else engine.state
