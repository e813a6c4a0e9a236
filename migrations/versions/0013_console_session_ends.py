"""console_session_ends: console sessions ended by signing out

Revision ID: 0013_console_session_ends
Revises: 0012_actor_names
Create Date: 2026-12-06

Signing out of the console records the session's id until the cookie would have expired, so that a
copy of the cookie is refused afterwards (control_plane/ui/session.py).
"""

from __future__ import annotations

import sqlalchemy as sa
from advanced_alchemy.types import DateTimeUTC
from alembic import op

revision = "0013_console_session_ends"
down_revision = "0012_actor_names"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # as in 0001: SQLite's ROWID assigns them


def upgrade() -> None:
    op.create_table(
        "console_session_ends",
        sa.Column("id", _ID, sa.Identity(always=False, start=1, increment=1), nullable=False),
        sa.Column("sid", sa.String(64), nullable=False),
        sa.Column("expires_at", DateTimeUTC(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_console_session_ends"),
        sa.UniqueConstraint("sid", name="uq_console_session_ends_sid"),
    )
    op.create_index("ix_console_session_ends_expires_at", "console_session_ends", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_console_session_ends_expires_at", table_name="console_session_ends")
    op.drop_table("console_session_ends")
