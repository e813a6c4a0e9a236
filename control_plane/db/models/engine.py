"""engines: data-plane engines known to the control plane and what they last reported."""

from __future__ import annotations

import datetime as dt
import enum

from advanced_alchemy.base import IdentityAuditBase
from advanced_alchemy.types import DateTimeUTC
from sqlalchemy import BigInteger, Boolean, Integer, String, true
from sqlalchemy.orm import Mapped, mapped_column


class EngineState(enum.StrEnum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"


class Engine(IdentityAuditBase):
    __tablename__ = "engines"

    name: Mapped[str] = mapped_column(String(128), unique=True)
    url: Mapped[str] = mapped_column(String(1024))  # its admin API (the control plane's pushes go there)
    # which engine serves (shared.engine_admin.EngineKind): `loraplane`, or one driven by `loraplane agent`
    kind: Mapped[str] = mapped_column(String(32), default="loraplane", server_default="loraplane")
    # where routers send inference when it is not `url` (an agent's engine: its OpenAI server); NULL: `url`
    inference_url: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    base_model: Mapped[str] = mapped_column(String(256), index=True)
    # Stored as text (not a database enum) so that adding a state needs no enum migration.
    state: Mapped[str] = mapped_column(String(16), default=EngineState.UNHEALTHY.value)
    last_heartbeat: Mapped[dt.datetime | None] = mapped_column(DateTimeUTC(timezone=True), nullable=True)
    slots_total: Mapped[int] = mapped_column(Integer, default=0)
    slots_used: Mapped[int] = mapped_column(Integer, default=0)
    # What the engine serves besides its served name (`base_model`): an adapter's base model matches an
    # engine by any of these (its checkpoint's _name_or_path, model path, sha256 of its config.json).
    model_name_or_path: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    model_path: Mapped[str | None] = mapped_column(String(4096), nullable=True)
    config_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    device_kind: Mapped[str | None] = mapped_column(String(32), nullable=True)  # cpu | cuda | npu
    max_lora_rank: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    max_cpu_loras: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # host-cache slots
    cache_bytes_free: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # --lora-cache-dir room
    # its context length (routers reserve a tenant's tokens by it); NULL: the engine did not say
    max_model_len: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # registered by its own engine credential (not an admin token): routers send it the engines' inference
    # key only then (rows older than the column: true, until they register again)
    credentialed: Mapped[bool] = mapped_column(Boolean, default=False, server_default=true())
