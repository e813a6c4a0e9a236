"""fleet: what engines serve, replica counts and demand per adapter, residency per placement

Revision ID: 0004_fleet
Revises: 0003_artifact_store
Create Date: 2026-12-03

- engines: what an engine registers besides its served name (`base_model`), so that an adapter's base
  model matches it by any of them: the checkpoint's `_name_or_path`, its model path, a digest of its
  config.json; and what placement weighs: device kind, max LoRA rank, device slots (`slots_total`,
  already there), host-cache slots, free host-cache bytes.
- adapters: `replicas {min, max}` (NULL: the control plane's defaults; max 0 means "all"), the replica
  count demand scaling chose (`target_replicas`, NULL: min) and its bookkeeping (`scale_state`: when
  demand went high or idle, the last decision and the figures behind it; `unloaded`: set by an unload,
  cleared by a load — adapters unloaded before this revision, placements and none held, get it here).
- demand_reports: the latest waiting/running figures per (source, adapter), a source being an engine's
  stats or a router's report; scaling sums the fresh ones.
- placements.residency: where the engine last said it keeps the version (device | host), for routing.
- audit_events.detail: what a decision was based on (demand scaling's reason and figures), when it says.
"""

from __future__ import annotations

import sqlalchemy as sa
from advanced_alchemy.types import DateTimeUTC
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0004_fleet"
down_revision = "0003_artifact_store"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # as in 0001: SQLite's ROWID assigns them
_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")

_ENGINE_COLUMNS = ("model_name_or_path", "model_path", "config_digest", "device_kind", "max_lora_rank",
                   "max_cpu_loras", "cache_bytes_free")
_ADAPTER_COLUMNS = ("min_replicas", "max_replicas", "target_replicas", "scale_state")


def upgrade() -> None:
    with op.batch_alter_table("engines") as batch:
        batch.add_column(sa.Column("model_name_or_path", sa.String(1024), nullable=True))
        batch.add_column(sa.Column("model_path", sa.String(4096), nullable=True))
        batch.add_column(sa.Column("config_digest", sa.String(64), nullable=True))
        batch.add_column(sa.Column("device_kind", sa.String(32), nullable=True))
        batch.add_column(sa.Column("max_lora_rank", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("max_cpu_loras", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("cache_bytes_free", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("adapters") as batch:
        batch.add_column(sa.Column("min_replicas", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("max_replicas", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("target_replicas", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("scale_state", _JSON, nullable=True))
    flag = """'{"unloaded": true}'""" + ("::jsonb" if op.get_bind().dialect.name == "postgresql" else "")
    op.execute(f"UPDATE adapters SET scale_state = {flag} WHERE id IN (SELECT v.adapter_id FROM adapter_versions v "
               "JOIN placements p ON p.adapter_version_id = v.id GROUP BY v.adapter_id "
               "HAVING SUM(CASE WHEN p.desired IN ('loaded', 'pinned') THEN 1 ELSE 0 END) = 0)")
    with op.batch_alter_table("placements") as batch:
        batch.add_column(sa.Column("residency", sa.String(16), nullable=True))
    with op.batch_alter_table("audit_events") as batch:
        batch.add_column(sa.Column("detail", _JSON, nullable=True))
    op.create_table(
        "demand_reports",
        sa.Column("id", _ID, sa.Identity(always=False, start=1, increment=1), nullable=False),
        sa.Column("source", sa.String(160), nullable=False),  # "engine:<name>" or "router:<token id>"
        sa.Column("adapter_id", sa.BigInteger(), nullable=False),
        sa.Column("waiting", sa.Integer(), nullable=False),
        sa.Column("running", sa.Integer(), nullable=False),
        sa.Column("tokens_per_s", sa.Float(), nullable=False),
        sa.Column("reported_at", DateTimeUTC(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["adapter_id"], ["adapters.id"], name="fk_demand_reports_adapter_id_adapters",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_demand_reports"),
        sa.UniqueConstraint("source", "adapter_id", name="uq_demand_reports_source_adapter_id"),
    )
    op.create_index("ix_demand_reports_adapter_id", "demand_reports", ["adapter_id"])


def downgrade() -> None:
    op.drop_index("ix_demand_reports_adapter_id", table_name="demand_reports")
    op.drop_table("demand_reports")
    with op.batch_alter_table("audit_events") as batch:
        batch.drop_column("detail")
    with op.batch_alter_table("placements") as batch:
        batch.drop_column("residency")
    with op.batch_alter_table("adapters") as batch:
        for column in reversed(_ADAPTER_COLUMNS):
            batch.drop_column(column)
    with op.batch_alter_table("engines") as batch:
        for column in reversed(_ENGINE_COLUMNS):
            batch.drop_column(column)
