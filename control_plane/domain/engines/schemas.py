"""Wire schemas of the engines API (msgspec): `Engine` answers; the requests engines send
(`EngineCreate`, `EngineHeartbeat`) are defined once, for both sides, in shared.engine_admin."""

from __future__ import annotations

import datetime as dt

import msgspec

from shared.engine_admin import EngineHeartbeat
from shared.engine_admin import EngineRegistration as EngineCreate

__all__ = ["Engine", "EngineCreate", "EngineDeleted", "EngineHeartbeat", "EngineList", "ReconcileReport"]


class Engine(msgspec.Struct, kw_only=True):
    name: str
    kind: str  # loraplane | vllm (an engine driven by `loraplane agent`)
    url: str  # its admin API (and its inference too, without `inference_url`)
    inference_url: str | None  # where routers send inference; None: `url`
    base_model: str
    state: str  # healthy | unhealthy (its step loop died) | draining | stale (heartbeats missed)
    last_heartbeat: dt.datetime | None
    slots_total: int  # device slots (its --max-loras)
    slots_used: int
    # what it serves besides `base_model` (an adapter's base model matches any of them) and can hold
    model_name_or_path: str | None  # config.json's _name_or_path
    model_path: str | None
    config_digest: str | None  # sha256 of config.json
    device_kind: str | None  # cpu | cuda | npu
    max_lora_rank: int  # 0: not reported
    max_cpu_loras: int  # host-cache slots; 0: not reported
    cache_bytes_free: int | None  # free room of its artifact cache; None: not reported
    max_model_len: int | None  # its context length; None: not reported
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
