"""adapter_versions: immutable content of an adapter, numbered 1, 2, … per adapter.

Registering identical files again (same sha256) returns the existing row; the unique constraints are what
make concurrent identical registrations converge on one version. The columns sha256 … size_bytes hold the
version's shared.engine_admin.AdapterDescription (a table declares its columns; `as_description` gives it).
"""

from __future__ import annotations

import datetime as dt

from advanced_alchemy.base import IdentityBase
from advanced_alchemy.types import DateTimeUTC, JsonB
from sqlalchemy import BigInteger, Float, ForeignKey, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from shared.engine_admin import AdapterDescription


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class AdapterVersion(IdentityBase):
    __tablename__ = "adapter_versions"
    __table_args__ = (
        UniqueConstraint("adapter_id", "number", name="uq_adapter_versions_adapter_id_number"),
        UniqueConstraint("adapter_id", "sha256", name="uq_adapter_versions_adapter_id_sha256"),
    )

    adapter_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("adapters.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    uri: Mapped[str] = mapped_column(String(1024))
    sha256: Mapped[str] = mapped_column(String(64))
    rank: Mapped[int] = mapped_column(Integer)
    alpha: Mapped[float] = mapped_column(Float)
    target_modules: Mapped[list[str]] = mapped_column(JsonB, default=list)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True), default=_now)
    # who registered it: `<role>:<name>` as audit rows name actors (None: made before revision 0006)
    created_by: Mapped[str | None] = mapped_column(String(256), nullable=True)

    def as_description(self) -> AdapterDescription:
        return AdapterDescription(sha256=self.sha256, rank=self.rank, alpha=self.alpha,
                                  target_modules=list(self.target_modules), size_bytes=self.size_bytes)
