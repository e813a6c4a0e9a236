"""tenants.sources: where a tenant's own admin keys may load adapters from

Revision ID: 0009_tenant_sources
Revises: 0008_engine_max_model_len
Create Date: 2026-12-06

A JSON list of folder and URL prefixes (control_plane/domain/tenants/sources.py) that an operator sets;
a tenant key with admin:<tenant> may load a lora_path only under one of them. Every existing tenant gets
[] (its keys may upload files, and load nothing from the control plane's own disks or credentials).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0009_tenant_sources"
down_revision = "0008_engine_max_model_len"
branch_labels = None
depends_on = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")  # as in 0007


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("sources", _JSON, nullable=False, server_default=sa.text("'[]'")))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("sources")
