"""routers: the routers that reported to this control plane, one row per router name.

Each demand report carries the router's presence (control_plane/domain/routers) and replaces its row;
rows not seen for a day are deleted then, so the table holds the fleet's routers, not their history.
"""

from __future__ import annotations

import datetime as dt

from advanced_alchemy.base import IdentityBase
from advanced_alchemy.types import DateTimeUTC
from sqlalchemy import Float, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column


class RouterInstance(IdentityBase):
    __tablename__ = "routers"
    __table_args__ = (UniqueConstraint("name", name="uq_routers_name"),)

    name: Mapped[str] = mapped_column(String(256))
    token_id: Mapped[str] = mapped_column(String(32))  # which router token reported it (as audit actors)
    url: Mapped[str | None] = mapped_column(String(1024), nullable=True)  # shown, never called
    running: Mapped[int] = mapped_column(Integer)  # requests it has sent to engines and not finished
    waiting: Mapped[int] = mapped_column(Integer)  # requests it holds until their adapter is placed
    table_age_s: Mapped[float | None] = mapped_column(Float, nullable=True)  # its routing table's age
    first_seen_at: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True))
    last_seen_at: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True))
