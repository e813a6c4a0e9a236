"""adapters: one row per adapter name; `active_version_id` is the version pin engines serve."""

from __future__ import annotations

from typing import Any

from advanced_alchemy.base import IdentityAuditBase
from advanced_alchemy.types import JsonB
from sqlalchemy import BigInteger, Boolean, ForeignKey, Integer, String, Text, false
from sqlalchemy.orm import Mapped, mapped_column


class Adapter(IdentityAuditBase):
    __tablename__ = "adapters"

    name: Mapped[str] = mapped_column(String(128), unique=True)
    base_model: Mapped[str] = mapped_column(String(256), index=True)
    description: Mapped[str] = mapped_column(Text, default="")
    labels: Mapped[dict[str, Any]] = mapped_column(JsonB, default=dict)
    # Circular with adapter_versions.adapter_id, so the constraint is added after both tables exist
    # (use_alter) and the column is set in a second statement after the version's insert.
    active_version_id: Mapped[int | None] = mapped_column(
        BigInteger,
        ForeignKey("adapter_versions.id", name="fk_adapters_active_version_id", use_alter=True,
                   ondelete="SET NULL"),
        nullable=True,
    )
    # replicas {min, max}: NULL means the control plane's defaults; max 0 means "all" matching engines
    min_replicas: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_replicas: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # the replica count demand scaling chose (NULL: min) and its bookkeeping (when demand went high or
    # idle, the last decision with its reason and figures)
    target_replicas: Mapped[int | None] = mapped_column(Integer, nullable=True)
    scale_state: Mapped[dict[str, Any] | None] = mapped_column(JsonB, nullable=True)
    # tenancy: the owner tenant (null: nobody's) and whether every tenant may use it; under the router's
    # --require-api-key an adapter is usable by its owner's keys, and by every key when public
    owner_tenant_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("tenants.id", name="fk_adapters_owner_tenant_id", ondelete="RESTRICT"),
        nullable=True, index=True)
    public: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
