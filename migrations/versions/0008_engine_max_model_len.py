"""engines.max_model_len: the context length an engine registers

Revision ID: 0008_engine_max_model_len
Revises: 0007_tenants
Create Date: 2026-12-06

- engines.max_model_len (NULL: the engine did not say, as every engine registered before this revision
  until it registers again): the routing table carries the smallest per base model, and routers reserve
  a tenant's tokens by it when a request sets no max_tokens.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_engine_max_model_len"
down_revision = "0007_tenants"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("engines") as batch:
        batch.add_column(sa.Column("max_model_len", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("engines") as batch:
        batch.drop_column("max_model_len")
