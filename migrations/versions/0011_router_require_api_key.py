"""routers.require_api_key: whether a router refuses clients without a key

Revision ID: 0011_router_require_api_key
Revises: 0010_engine_credentialed
Create Date: 2026-12-06

Routers report it with their presence; the control plane's /health, the console's Fleet page and the
answers of tenancy changes (an adapter made private, a quota set) say whether any router enforces tenant
keys. Rows of routers that reported before it existed say false until their next report.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011_router_require_api_key"
down_revision = "0010_engine_credentialed"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("routers") as batch:
        batch.add_column(sa.Column("require_api_key", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("routers") as batch:
        batch.drop_column("require_api_key")
