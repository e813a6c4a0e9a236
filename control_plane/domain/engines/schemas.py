"""Wire schemas of the engines API (msgspec): `Engine` answers, `EngineCreate` / `EngineHeartbeat` requests."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

import msgspec

from control_plane.db.models.adapter import ADAPTER_NAME_PATTERN

EngineName = Annotated[str, msgspec.Meta(pattern=ADAPTER_NAME_PATTERN, description="letters, digits, `._-/:`, ≤ 128")]
Slots = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]


class EngineCreate(msgspec.Struct, kw_only=True):
    """POST /v1/engines/register: idempotent by name (a re-registration updates url, base model, slots)."""

    name: EngineName
    url: Annotated[str, msgspec.Meta(pattern=r"^https?://\S+$", max_length=1024)]
    base_model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    slots_total: Slots = 0


class EngineHeartbeat(msgspec.Struct, kw_only=True):
    """POST /v1/engines/{name}/heartbeat."""

    slots_used: Slots | None = None
    slots_total: Slots | None = None


class Engine(msgspec.Struct, kw_only=True):
    name: str
    url: str
    base_model: str
    state: str  # healthy | unhealthy (stored, or heartbeats missed) | draining
    last_heartbeat: dt.datetime | None
    slots_total: int
    slots_used: int
    created_at: dt.datetime
    updated_at: dt.datetime


class EngineList(msgspec.Struct, kw_only=True):
    data: list[Engine]


class EngineDeleted(msgspec.Struct, kw_only=True):
    name: str
    deleted: bool = True


class EngineReconciled(msgspec.Struct, kw_only=True):
    engine: str
    loaded: list[str]
    unloaded: list[str]
    failed: list[str]
    skipped: bool  # unreachable, or being reconciled by another replica


class ReconcileReport(msgspec.Struct, kw_only=True):
    engines: list[EngineReconciled]
