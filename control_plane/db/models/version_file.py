"""version_files: a version's manifest, one row per file (its name in the PEFT folder and its blob).

A version's sha256 (adapter_versions.sha256) is the manifest digest of exactly these rows (shared.manifest).
Versions recorded before the artifact store existed have no rows: they are still served from their path.
"""

from __future__ import annotations

from advanced_alchemy.base import IdentityBase
from sqlalchemy import BigInteger, ForeignKey, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column


class VersionFile(IdentityBase):
    __tablename__ = "version_files"
    __table_args__ = (
        UniqueConstraint("adapter_version_id", "name", name="uq_version_files_adapter_version_id_name"),
    )

    adapter_version_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("adapter_versions.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(128))
    # RESTRICT: a blob row cannot go while a manifest lists it (the store object goes after the row)
    blob_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("artifact_blobs.id", ondelete="RESTRICT"), index=True)
