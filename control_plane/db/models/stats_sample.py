"""stats_samples: each adapter's fleet-wide counters and TTFT percentiles, sampled every reconcile
interval (control_plane/domain/stats/history.py), kept for HISTORY_S: the console's charts."""

from __future__ import annotations

import datetime as dt

from advanced_alchemy.base import IdentityBase
from advanced_alchemy.types import DateTimeUTC
from sqlalchemy import BigInteger, Float, Index, String
from sqlalchemy.orm import Mapped, mapped_column


class StatsSample(IdentityBase):
    __tablename__ = "stats_samples"
    __table_args__ = (Index("ix_stats_samples_adapter_at", "adapter", "at"),)

    adapter: Mapped[str] = mapped_column(String(256))  # by name: a sample outlives nothing it would need
    at: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True), index=True)
    requests: Mapped[int] = mapped_column(BigInteger)  # finished requests, every outcome, summed over engines
    errors: Mapped[int] = mapped_column(BigInteger)  # of which outcome "error"
    generated_tokens: Mapped[int] = mapped_column(BigInteger)
    # TTFT over the requests finished since this process's previous sample (None: none, or no previous)
    ttft_p50: Mapped[float | None] = mapped_column(Float, nullable=True)
    ttft_p99: Mapped[float | None] = mapped_column(Float, nullable=True)
