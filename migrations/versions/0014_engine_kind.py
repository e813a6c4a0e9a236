"""engines.kind and engines.inference_url: which engine serves, and where routers send its inference

Revision ID: 0014_engine_kind
Revises: 0013_console_session_ends
Create Date: 2026-12-07

- engines.kind: `loraplane` (this project's engine) or the kind of an engine driven by `loraplane agent`
  (`vllm`). Rows registered before this revision are `loraplane`: no other kind could register.
- engines.inference_url (NULL: inference goes to engines.url, as for every row before this revision):
  an agent's engine registers its admin API as `url` and its OpenAI server here; the routing table
  carries it, and routers send inference to it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014_engine_kind"
down_revision = "0013_console_session_ends"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("engines") as batch:
        batch.add_column(sa.Column("kind", sa.String(32), nullable=False, server_default="loraplane"))
        batch.add_column(sa.Column("inference_url", sa.String(1024), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("engines") as batch:
        batch.drop_column("inference_url")
        batch.drop_column("kind")
