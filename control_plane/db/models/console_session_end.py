"""console_session_ends: console sessions ended by signing out, refused until they would have expired.

A console cookie is signed, not stored; signing out records its session id here, so that a copy of the
cookie (kept by a browser, a proxy's log, an attacker) is refused afterwards, on every replica and after a
restart. Rows past `expires_at` are of no use (the cookie is refused as expired) and are removed.
"""

from __future__ import annotations

import datetime as dt

from advanced_alchemy.base import IdentityBase
from advanced_alchemy.types import DateTimeUTC
from sqlalchemy import String
from sqlalchemy.orm import Mapped, mapped_column


class ConsoleSessionEnd(IdentityBase):
    __tablename__ = "console_session_ends"

    sid: Mapped[str] = mapped_column(String(64), unique=True)
    expires_at: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True), index=True)
