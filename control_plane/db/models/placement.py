"""placements: engine × adapter version, what the control plane wants there and what the engine has."""

from __future__ import annotations

import enum

from advanced_alchemy.base import IdentityAuditBase
from sqlalchemy import BigInteger, ForeignKey, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column


class DesiredState(enum.StrEnum):
    ABSENT = "absent"
    LOADED = "loaded"
    PINNED = "pinned"  # loaded and never evicted from the engine's device slots


# The desired states in which an engine is to hold the version (loaded, or loaded and pinned).
HOLDING = (DesiredState.LOADED.value, DesiredState.PINNED.value)


class ObservedState(enum.StrEnum):
    ABSENT = "absent"
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"
    DRAINING = "draining"


class Placement(IdentityAuditBase):
    __tablename__ = "placements"
    __table_args__ = (
        UniqueConstraint("engine_id", "adapter_version_id", name="uq_placements_engine_id_adapter_version_id"),
    )

    engine_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("engines.id", ondelete="CASCADE"))
    adapter_version_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("adapter_versions.id", ondelete="CASCADE"), index=True
    )
    desired: Mapped[str] = mapped_column(String(16), default=DesiredState.LOADED.value)
    observed: Mapped[str] = mapped_column(String(16), default=ObservedState.ABSENT.value)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    residency: Mapped[str | None] = mapped_column(String(16), nullable=True)  # device | host, as last read
