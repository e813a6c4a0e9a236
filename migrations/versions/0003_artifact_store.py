"""artifact store: artifact_blobs (file contents in the store, by sha256) and version_files (manifests)

Revision ID: 0003_artifact_store
Revises: 0002_manifest_digest
Create Date: 2026-12-02

Versions recorded before this revision keep no files in the store: they have no version_files rows and
are still pushed by their path (engines must read it, as before). Registering the same folder again
records its files in the store; the version (same manifest digest) is the same one.
"""

from __future__ import annotations

import sqlalchemy as sa
from advanced_alchemy.types import DateTimeUTC
from alembic import op

revision = "0003_artifact_store"
down_revision = "0002_manifest_digest"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # as in 0001: SQLite's ROWID assigns them


def _id() -> sa.Column:
    return sa.Column("id", _ID, sa.Identity(always=False, start=1, increment=1), nullable=False)


def upgrade() -> None:
    op.create_table(
        "artifact_blobs", _id(),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("created_at", DateTimeUTC(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_artifact_blobs"),
        sa.UniqueConstraint("sha256", name="uq_artifact_blobs_sha256"),
    )
    op.create_table(
        "version_files", _id(),
        sa.Column("adapter_version_id", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("blob_id", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["adapter_version_id"], ["adapter_versions.id"],
                                name="fk_version_files_adapter_version_id_adapter_versions", ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["blob_id"], ["artifact_blobs.id"], name="fk_version_files_blob_id_artifact_blobs",
                                ondelete="RESTRICT"),
        sa.PrimaryKeyConstraint("id", name="pk_version_files"),
        sa.UniqueConstraint("adapter_version_id", "name", name="uq_version_files_adapter_version_id_name"),
    )
    op.create_index("ix_version_files_blob_id", "version_files", ["blob_id"])


def downgrade() -> None:
    op.drop_index("ix_version_files_blob_id", table_name="version_files")
    op.drop_table("version_files")
    op.drop_table("artifact_blobs")
