"""artifact_blobs: one row per file content the artifact store holds (`blobs/<sha256>`), shared by every
version whose manifest lists it. A row exists while some version references it (version_files); the
last reference's removal deletes the row and then the object (control_plane/artifacts/blobs.py)."""

from __future__ import annotations

import datetime as dt

from advanced_alchemy.base import IdentityBase
from advanced_alchemy.types import DateTimeUTC
from sqlalchemy import BigInteger, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class ArtifactBlob(IdentityBase):
    __tablename__ = "artifact_blobs"
    __table_args__ = (UniqueConstraint("sha256", name="uq_artifact_blobs_sha256"),)

    sha256: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True), default=_now)
