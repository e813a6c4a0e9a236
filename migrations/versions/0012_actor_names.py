"""audit_events.actor and adapter_versions.created_by: room for `role:name`

Revision ID: 0012_actor_names
Revises: 0011_router_require_api_key
Create Date: 2026-12-06

The caller is named by its role and its token's or key's name (`admin:ops`, `engine:local-1`,
`tenant:team-a/ci`), no longer only by a short sha256 prefix; existing rows keep what they hold.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012_actor_names"
down_revision = "0011_router_require_api_key"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("audit_events") as batch:
        batch.alter_column("actor", type_=sa.String(256), existing_type=sa.String(32), existing_nullable=False)
    with op.batch_alter_table("adapter_versions") as batch:
        batch.alter_column("created_by", type_=sa.String(256), existing_type=sa.String(64), existing_nullable=True)


def downgrade() -> None:  # longer names are cut to the old widths first
    op.execute("UPDATE adapter_versions SET created_by = substr(created_by, 1, 64)")
    op.execute("UPDATE audit_events SET actor = substr(actor, 1, 32)")
    with op.batch_alter_table("adapter_versions") as batch:
        batch.alter_column("created_by", type_=sa.String(64), existing_type=sa.String(256), existing_nullable=True)
    with op.batch_alter_table("audit_events") as batch:
        batch.alter_column("actor", type_=sa.String(32), existing_type=sa.String(256), existing_nullable=False)
