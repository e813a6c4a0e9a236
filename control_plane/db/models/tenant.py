"""tenants: one row per team whose keys use the fleet; its quotas are shared by all its keys.

A null quota is unlimited. Adapters name their owner tenant (adapters.owner_tenant_id); a tenant that
owns adapters cannot be deleted (RESTRICT), so its private adapters never turn into nobody's.
"""

from __future__ import annotations

from advanced_alchemy.base import IdentityAuditBase
from advanced_alchemy.types import JsonB
from sqlalchemy import BigInteger, Integer, String, text
from sqlalchemy.orm import Mapped, mapped_column


class Tenant(IdentityAuditBase):
    __tablename__ = "tenants"

    name: Mapped[str] = mapped_column(String(63), unique=True)
    display_name: Mapped[str] = mapped_column(String(256), default="")
    requests_per_minute: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    concurrent_requests: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_adapters: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # where its admin keys may load from: folder and URL prefixes (domain/tenants/sources.py); [] uploads only
    sources: Mapped[list[str]] = mapped_column(JsonB, default=list, server_default=text("'[]'"))
