"""engines.credentialed: whether an engine registered itself with its own engine credential

Revision ID: 0010_engine_credentialed
Revises: 0009_tenant_sources
Create Date: 2026-12-06

- engines.credentialed: true when the last registration came from the engine's own token
  (LORAPLANE_ENGINE_CREDENTIALS), false when an admin token registered it. The routing table carries it,
  and routers send the engines' inference key (LORAPLANE_ENGINE_API_KEY) only to credentialed engines.
  Rows registered before this revision are true (they were sent the key before it), until their next
  registration says which.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010_engine_credentialed"
down_revision = "0009_tenant_sources"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("engines") as batch:
        batch.add_column(sa.Column("credentialed", sa.Boolean(), nullable=False, server_default=sa.true()))


def downgrade() -> None:
    with op.batch_alter_table("engines") as batch:
        batch.drop_column("credentialed")
