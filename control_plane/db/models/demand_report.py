"""demand_reports: the latest queue figures per (source, adapter), for demand scaling.

A source is one engine's stats (`engine:<name>`) or one router's report (`router:<token id>`, or
`router:<token id>:<router name>` when the router names itself); each report replaces that source's rows,
and scaling combines the rows fresher than its window so that a request a router sent to an engine counts
once (control_plane.domain.placements.demand.current_demand).
"""

from __future__ import annotations

import datetime as dt

from advanced_alchemy.base import IdentityBase
from advanced_alchemy.types import DateTimeUTC
from sqlalchemy import BigInteger, Float, ForeignKey, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column


class DemandReport(IdentityBase):
    __tablename__ = "demand_reports"
    __table_args__ = (UniqueConstraint("source", "adapter_id", name="uq_demand_reports_source_adapter_id"),)

    source: Mapped[str] = mapped_column(String(160))
    adapter_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("adapters.id", ondelete="CASCADE"), index=True)
    waiting: Mapped[int] = mapped_column(Integer)
    running: Mapped[int] = mapped_column(Integer)
    tokens_per_s: Mapped[float] = mapped_column(Float)
    reported_at: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True))
