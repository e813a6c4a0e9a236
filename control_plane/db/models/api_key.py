"""api_keys: a tenant's keys. `key_id` is the public part of `lp_<key_id>_<secret>` (found without a
scan); only a keyed hash of the key is kept (shared/key_secrets.py), never the secret. Revoked keys keep
their row (the audit trail and `last_used_at` stay readable)."""

from __future__ import annotations

import datetime as dt

from advanced_alchemy.base import IdentityBase
from advanced_alchemy.types import DateTimeUTC, JsonB
from sqlalchemy import BigInteger, ForeignKey, Integer, String
from sqlalchemy.orm import Mapped, mapped_column


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class ApiKey(IdentityBase):
    __tablename__ = "api_keys"

    key_id: Mapped[str] = mapped_column(String(32), unique=True)
    tenant_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    secret_hash: Mapped[str] = mapped_column(String(256))
    scopes: Mapped[list[str]] = mapped_column(JsonB, default=list)
    # the key's own quotas (null: only the tenant's apply)
    requests_per_minute: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    concurrent_requests: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True), default=_now)
    expires_at: Mapped[dt.datetime | None] = mapped_column(DateTimeUTC(timezone=True), nullable=True)
    last_used_at: Mapped[dt.datetime | None] = mapped_column(DateTimeUTC(timezone=True), nullable=True)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(DateTimeUTC(timezone=True), nullable=True)
