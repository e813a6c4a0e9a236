"""routers: the routers that reported to this control plane, one row per router name.

Each demand report carries the router's presence (control_plane/domain/routers) and replaces its row;
rows not seen for a day are deleted then, so the table holds the fleet's routers, not their history.
"""

from __future__ import annotations

import datetime as dt

from advanced_alchemy.base import IdentityBase
from advanced_alchemy.types import DateTimeUTC
from sqlalchemy import Boolean, Float, Integer, String, UniqueConstraint, false
from sqlalchemy.orm import Mapped, mapped_column

# a router reports at least every 5 s by default: one silent for three of those is shown stale
ROUTER_STALE_AFTER_S = 15.0


class RouterInstance(IdentityBase):
    __tablename__ = "routers"
    __table_args__ = (UniqueConstraint("name", name="uq_routers_name"),)

    name: Mapped[str] = mapped_column(String(256))
    token_id: Mapped[str] = mapped_column(String(32))  # which router token reported it (as audit actors)
    url: Mapped[str | None] = mapped_column(String(1024), nullable=True)  # shown, never called
    running: Mapped[int] = mapped_column(Integer)  # requests it has sent to engines and not finished
    waiting: Mapped[int] = mapped_column(Integer)  # requests it holds until their adapter is placed
    table_age_s: Mapped[float | None] = mapped_column(Float, nullable=True)  # its routing table's age
    # it refuses clients without a key (--require-api-key): tenants' privacy and quotas hold behind it
    require_api_key: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    first_seen_at: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True))
    last_seen_at: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True))
