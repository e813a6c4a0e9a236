"""AuditService: pages of the audit trail, newest first, filtered by adapter, actor, action and time."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy import ColumnElement, Select, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.db.models import AuditEvent
from control_plane.db.transaction import read
from control_plane.domain.audit import schemas
from shared.errors import InvalidRequestError

MAX_PAGE = 500


@dataclass(frozen=True)
class AuditQuery:
    limit: int = 100
    offset: int = 0
    adapter: str | None = None  # rows on this adapter: target `name` or `name@version`
    actor: str | None = None
    action: str | None = None
    since: dt.datetime | None = None  # aware, UTC

    def __post_init__(self) -> None:
        if not 1 <= self.limit <= MAX_PAGE:
            raise InvalidRequestError(f"limit must be in 1..{MAX_PAGE}", param="limit")
        if self.offset < 0:
            raise InvalidRequestError("offset must be ≥ 0", param="offset")


def parse_time(text: str, param: str) -> dt.datetime | None:
    """An RFC 3339 time (its form checked by the route's pattern), None for ""; 400 for a day or hour that
    does not exist (2026-02-30, 25:00)."""
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(text.upper())
    except ValueError:
        raise InvalidRequestError(f"{param} {text!r} is not a valid RFC 3339 time", param=param) from None


def as_utc(when: dt.datetime | None) -> dt.datetime | None:
    """`since` as an aware UTC time (no offset given: UTC); 400 for one UTC cannot hold (year 9999 at -14:00)."""
    if when is None:
        return None
    try:
        return when.replace(tzinfo=when.tzinfo or dt.UTC).astimezone(dt.UTC)
    except OverflowError:
        raise InvalidRequestError(f"since {when.isoformat()} lies outside the years UTC can hold", param="since") from None


def _conditions(query: AuditQuery) -> list[ColumnElement[bool]]:
    where: list[ColumnElement[bool]] = []
    if query.adapter:
        where.append(or_(AuditEvent.target == query.adapter,
                         AuditEvent.target.startswith(query.adapter + "@", autoescape=True)))
    if query.actor:
        where.append(AuditEvent.actor == query.actor)
    if query.action:
        where.append(AuditEvent.action == query.action)
    if query.since is not None:
        where.append(AuditEvent.at >= query.since)
    return where


async def _page(session: AsyncSession, query: AuditQuery) -> schemas.AuditPage:
    where = _conditions(query)
    total = await session.scalar(select(func.count()).select_from(AuditEvent).where(*where))
    stmt: Select[tuple[AuditEvent]] = (
        select(AuditEvent).where(*where).order_by(AuditEvent.at.desc(), AuditEvent.id.desc())
        .limit(query.limit).offset(query.offset))
    rows = (await session.scalars(stmt)).all()
    return schemas.AuditPage(
        data=[schemas.AuditEvent(id=r.id, at=r.at, actor=r.actor, action=r.action, target=r.target,
                                 outcome=r.outcome, detail=r.detail) for r in rows],
        total=total or 0, limit=query.limit, offset=query.offset)


class AuditService:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def page(self, query: AuditQuery) -> schemas.AuditPage:
        # retried on a fresh connection when the database connection broke under it (db.transaction.read)
        return await read(self.session, lambda: _page(self.session, query), "list audit events")
