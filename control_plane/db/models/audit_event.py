"""audit_events: one row per mutating admin call, whether it succeeded or was refused.

`actor` is the caller's role and its token's or key's name (`admin:ops`); a token given without a name is
named by a short sha256 prefix of it: enough to tell tokens apart in an audit, useless for recovering it.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from advanced_alchemy.base import IdentityBase
from advanced_alchemy.types import DateTimeUTC, JsonB
from sqlalchemy import String
from sqlalchemy.orm import Mapped, mapped_column


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class AuditEvent(IdentityBase):
    __tablename__ = "audit_events"

    actor: Mapped[str] = mapped_column(String(256))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(256))
    outcome: Mapped[str] = mapped_column(String(64))
    at: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True), default=_now, index=True)
    # what a decision was based on (demand scaling: its reason and figures), a re-target's `from` and `to`
    # base model; None for other admin calls
    detail: Mapped[dict[str, Any] | None] = mapped_column(JsonB, nullable=True)
