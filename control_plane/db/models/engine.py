"""engines: data-plane engines known to the control plane and what they last reported."""

from __future__ import annotations

import datetime as dt
import enum

from advanced_alchemy.base import IdentityAuditBase
from advanced_alchemy.types import DateTimeUTC
from sqlalchemy import Integer, String
from sqlalchemy.orm import Mapped, mapped_column


class EngineState(enum.StrEnum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"


class Engine(IdentityAuditBase):
    __tablename__ = "engines"

    name: Mapped[str] = mapped_column(String(128), unique=True)
    url: Mapped[str] = mapped_column(String(1024))
    base_model: Mapped[str] = mapped_column(String(256), index=True)
    # Stored as text (not a database enum) so that adding a state needs no enum migration.
    state: Mapped[str] = mapped_column(String(16), default=EngineState.UNHEALTHY.value)
    last_heartbeat: Mapped[dt.datetime | None] = mapped_column(DateTimeUTC(timezone=True), nullable=True)
    slots_total: Mapped[int] = mapped_column(Integer, default=0)
    slots_used: Mapped[int] = mapped_column(Integer, default=0)
