"""routers and adapter_versions.created_by: the console's Fleet page lists the routers; a version says who

Revision ID: 0006_routers_authors
Revises: 0005_stats_samples
Create Date: 2026-12-03

A router reports itself with its demand report (every `presence_interval_s` even when idle); each report
replaces its row by name, and the Fleet page shows the rows seen recently. `created_by` is the principal
that registered the version (`<role>:<token id>`, as audit rows name actors); versions made before this
revision have none.
"""

from __future__ import annotations

import sqlalchemy as sa
from advanced_alchemy.types import DateTimeUTC
from alembic import op

revision = "0006_routers_authors"
down_revision = "0005_stats_samples"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # as in 0001: SQLite's ROWID assigns them


def upgrade() -> None:
    op.create_table(
        "routers",
        sa.Column("id", _ID, sa.Identity(always=False, start=1, increment=1), nullable=False),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("token_id", sa.String(32), nullable=False),
        sa.Column("url", sa.String(1024), nullable=True),
        sa.Column("running", sa.Integer(), nullable=False),
        sa.Column("waiting", sa.Integer(), nullable=False),
        sa.Column("table_age_s", sa.Float(), nullable=True),
        sa.Column("first_seen_at", DateTimeUTC(timezone=True), nullable=False),
        sa.Column("last_seen_at", DateTimeUTC(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_routers"),
        sa.UniqueConstraint("name", name="uq_routers_name"),
    )
    with op.batch_alter_table("adapter_versions") as batch:
        batch.add_column(sa.Column("created_by", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("adapter_versions") as batch:
        batch.drop_column("created_by")
    op.drop_table("routers")
