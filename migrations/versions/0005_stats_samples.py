"""stats_samples: per adapter, the fleet's counters and TTFT percentiles every reconcile interval

Revision ID: 0005_stats_samples
Revises: 0004_fleet
Create Date: 2026-12-03

The console's charts (tokens/s, requests/s, TTFT p50/p99, error rate over the last hour) read this table,
so they need no Prometheus and every replica shows the same history; the sampler deletes rows older
than its window, so the table stays bounded (adapters x samples per hour).
"""

from __future__ import annotations

import sqlalchemy as sa
from advanced_alchemy.types import DateTimeUTC
from alembic import op

revision = "0005_stats_samples"
down_revision = "0004_fleet"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # as in 0001: SQLite's ROWID assigns them


def upgrade() -> None:
    op.create_table(
        "stats_samples",
        sa.Column("id", _ID, sa.Identity(always=False, start=1, increment=1), nullable=False),
        sa.Column("adapter", sa.String(256), nullable=False),
        sa.Column("at", DateTimeUTC(timezone=True), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("errors", sa.BigInteger(), nullable=False),
        sa.Column("generated_tokens", sa.BigInteger(), nullable=False),
        sa.Column("ttft_p50", sa.Float(), nullable=True),
        sa.Column("ttft_p99", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_stats_samples"),
    )
    op.create_index("ix_stats_samples_adapter_at", "stats_samples", ["adapter", "at"])
    op.create_index("ix_stats_samples_at", "stats_samples", ["at"])


def downgrade() -> None:
    op.drop_index("ix_stats_samples_at", table_name="stats_samples")
    op.drop_index("ix_stats_samples_adapter_at", table_name="stats_samples")
    op.drop_table("stats_samples")
