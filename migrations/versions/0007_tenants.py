"""tenants, api_keys, and an owner tenant and a public flag on adapters

Revision ID: 0007_tenants
Revises: 0006_routers_authors
Create Date: 2026-12-03

- tenants: a team's name, display name and quotas (requests and tokens per minute, concurrent requests,
  adapters owned; NULL is unlimited).
- api_keys: a tenant's keys: the public key id that `lp_<key id>_<secret>` starts with (unique, so a key
  is found without a scan), the secret's argon2 hash (never the secret), scopes, the key's own quotas,
  expiry, last use and revocation.
- adapters.owner_tenant_id (NULL: nobody's; RESTRICT: a tenant owning adapters cannot go) and
  adapters.public (false for every existing adapter: under the router's --require-api-key an adapter is
  usable by its owner's keys, and by all keys only once marked public).
"""

from __future__ import annotations

import sqlalchemy as sa
from advanced_alchemy.types import DateTimeUTC
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0007_tenants"
down_revision = "0006_routers_authors"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # as in 0001: SQLite's ROWID assigns them
_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def _quotas() -> list[sa.Column]:
    return [sa.Column("requests_per_minute", sa.BigInteger(), nullable=True),
            sa.Column("tokens_per_minute", sa.BigInteger(), nullable=True),
            sa.Column("concurrent_requests", sa.Integer(), nullable=True)]


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", _ID, sa.Identity(always=False, start=1, increment=1), nullable=False),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("display_name", sa.String(256), nullable=False),
        *_quotas(),
        sa.Column("max_adapters", sa.Integer(), nullable=True),
        sa.Column("created_at", DateTimeUTC(timezone=True), nullable=False),
        sa.Column("updated_at", DateTimeUTC(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_tenants"),
        sa.UniqueConstraint("name", name="uq_tenants_name"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", _ID, sa.Identity(always=False, start=1, increment=1), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("secret_hash", sa.String(256), nullable=False),
        sa.Column("scopes", _JSON, nullable=False),
        *_quotas(),
        sa.Column("created_at", DateTimeUTC(timezone=True), nullable=False),
        sa.Column("expires_at", DateTimeUTC(timezone=True), nullable=True),
        sa.Column("last_used_at", DateTimeUTC(timezone=True), nullable=True),
        sa.Column("revoked_at", DateTimeUTC(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name="fk_api_keys_tenant_id_tenants",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.UniqueConstraint("key_id", name="uq_api_keys_key_id"),
    )
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])
    with op.batch_alter_table("adapters") as batch:
        batch.add_column(sa.Column("owner_tenant_id", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("public", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.create_foreign_key("fk_adapters_owner_tenant_id", "tenants", ["owner_tenant_id"], ["id"],
                                 ondelete="RESTRICT")
        batch.create_index("ix_adapters_owner_tenant_id", ["owner_tenant_id"])


def downgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.drop_index("ix_adapters_owner_tenant_id")
        batch.drop_constraint("fk_adapters_owner_tenant_id", type_="foreignkey")
        batch.drop_column("public")
        batch.drop_column("owner_tenant_id")
    op.drop_index("ix_api_keys_tenant_id", table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("tenants")
