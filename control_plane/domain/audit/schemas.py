"""Wire schemas of GET /v1/audit (msgspec)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec


class AuditEvent(msgspec.Struct, kw_only=True):
    """One mutating call, done or refused: who (`actor`, a short sha256 prefix of the token), what
    (`action` on `target`: an adapter name, `name@version`, an engine name or a path), and how it went
    (`outcome`: ok, or the refusal's status and error type)."""

    id: int
    at: dt.datetime
    actor: str
    action: str
    target: str
    outcome: str
    detail: dict[str, Any] | None  # demand scaling's reason and figures; a re-target's `from`, `to`; else None


class AuditPage(msgspec.Struct, kw_only=True):
    """Newest first; `total` counts every row the filters match."""

    data: list[AuditEvent]
    total: int
    limit: int
    offset: int
