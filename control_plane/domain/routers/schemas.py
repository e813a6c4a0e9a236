"""Wire schemas of GET /v1/routers (msgspec)."""

from __future__ import annotations

import datetime as dt

import msgspec


class Router(msgspec.Struct, kw_only=True):
    name: str
    url: str | None  # where clients reach it, as it reports (the control plane never calls it)
    state: str  # up: reported within `stale_after_s`; stale: not since
    running: int  # requests it had sent to engines and not finished, at its last report
    waiting: int  # requests it held for a placement, at its last report
    table_age_s: float | None  # how old its routing table was then (None: it had none yet)
    require_api_key: bool  # it refuses clients without a key: tenants' private adapters and quotas hold
    first_seen_at: dt.datetime
    last_seen_at: dt.datetime


class RouterList(msgspec.Struct, kw_only=True):
    data: list[Router]
    stale_after_s: float  # a router silent for longer is `stale`
