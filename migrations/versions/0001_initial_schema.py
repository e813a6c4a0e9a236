"""initial schema: adapters, adapter_versions, engines, placements, audit_events

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from advanced_alchemy.types import DateTimeUTC
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# What the ORM's types compile to: BIGINT identity keys (INTEGER on SQLite, so that ROWID assigns them),
# JSONB on PostgreSQL, UTC timestamps.
_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def _id() -> sa.Column:
    return sa.Column("id", _ID, sa.Identity(always=False, start=1, increment=1), nullable=False)


def _timestamps() -> list[sa.Column]:
    return [sa.Column("created_at", DateTimeUTC(timezone=True), nullable=False),
            sa.Column("updated_at", DateTimeUTC(timezone=True), nullable=False)]


def upgrade() -> None:
    op.create_table(
        "adapters", _id(),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("base_model", sa.String(256), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("labels", _JSON, nullable=False),
        sa.Column("active_version_id", sa.BigInteger(), nullable=True),
        *_timestamps(),
        sa.PrimaryKeyConstraint("id", name="pk_adapters"),
        sa.UniqueConstraint("name", name="uq_adapters_name"),
    )
    op.create_index("ix_adapters_base_model", "adapters", ["base_model"])
    op.create_table(
        "adapter_versions", _id(),
        sa.Column("adapter_id", sa.BigInteger(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("uri", sa.String(1024), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("alpha", sa.Float(), nullable=False),
        sa.Column("target_modules", _JSON, nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", DateTimeUTC(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["adapter_id"], ["adapters.id"], name="fk_adapter_versions_adapter_id_adapters",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_adapter_versions"),
        sa.UniqueConstraint("adapter_id", "number", name="uq_adapter_versions_adapter_id_number"),
        sa.UniqueConstraint("adapter_id", "sha256", name="uq_adapter_versions_adapter_id_sha256"),
    )
    # The two tables reference each other, so the version pin's constraint comes last (batch mode
    # rebuilds the still-empty table on SQLite, which cannot ALTER … ADD CONSTRAINT).
    with op.batch_alter_table("adapters") as batch:
        batch.create_foreign_key("fk_adapters_active_version_id", "adapter_versions", ["active_version_id"], ["id"],
                                 ondelete="SET NULL")
    op.create_table(
        "engines", _id(),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("url", sa.String(1024), nullable=False),
        sa.Column("base_model", sa.String(256), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("last_heartbeat", DateTimeUTC(timezone=True), nullable=True),
        sa.Column("slots_total", sa.Integer(), nullable=False),
        sa.Column("slots_used", sa.Integer(), nullable=False),
        *_timestamps(),
        sa.PrimaryKeyConstraint("id", name="pk_engines"),
        sa.UniqueConstraint("name", name="uq_engines_name"),
    )
    op.create_index("ix_engines_base_model", "engines", ["base_model"])
    op.create_table(
        "placements", _id(),
        sa.Column("engine_id", sa.BigInteger(), nullable=False),
        sa.Column("adapter_version_id", sa.BigInteger(), nullable=False),
        sa.Column("desired", sa.String(16), nullable=False),
        sa.Column("observed", sa.String(16), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        *_timestamps(),
        sa.ForeignKeyConstraint(["adapter_version_id"], ["adapter_versions.id"],
                                name="fk_placements_adapter_version_id_adapter_versions", ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["engine_id"], ["engines.id"], name="fk_placements_engine_id_engines",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_placements"),
        sa.UniqueConstraint("engine_id", "adapter_version_id", name="uq_placements_engine_id_adapter_version_id"),
    )
    op.create_index("ix_placements_adapter_version_id", "placements", ["adapter_version_id"])
    op.create_table(
        "audit_events", _id(),
        sa.Column("actor", sa.String(32), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("target", sa.String(256), nullable=False),
        sa.Column("outcome", sa.String(64), nullable=False),
        sa.Column("at", DateTimeUTC(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_audit_events"),
    )
    op.create_index("ix_audit_events_at", "audit_events", ["at"])


def downgrade() -> None:
    op.drop_table("audit_events")
    op.drop_table("placements")
    op.drop_table("engines")
    with op.batch_alter_table("adapters") as batch:
        batch.drop_constraint("fk_adapters_active_version_id", type_="foreignkey")
    op.drop_table("adapter_versions")
    op.drop_table("adapters")
