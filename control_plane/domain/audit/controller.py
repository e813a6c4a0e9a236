"""GET /v1/audit: one thin handler over AuditService; a read token sees the trail, nothing changes it."""

from __future__ import annotations

from typing import Annotated

from litestar import Controller, get
from litestar.di import Provide
from litestar.params import Parameter
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.auth import read_guard
from control_plane.db.paging import MAX_OFFSET
from control_plane.domain.audit import schemas
from control_plane.domain.audit.service import MAX_PAGE, AuditQuery, AuditService, as_utc, parse_time
from shared.openapi import route_doc

_NO_NUL = "^[^\\x00]*$"  # PostgreSQL text holds no NUL (a filter with one would be a 500)
_RFC3339 = r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$"


async def provide_audit_service(db_session: AsyncSession) -> AuditService:
    return AuditService(db_session)


class AuditController(Controller):
    path = "/v1"
    tags = ["audit"]
    guards = [read_guard]
    dependencies = {"service": Provide(provide_audit_service)}

    @get("/audit", operation_id="listAuditEvents", opt=route_doc(response=schemas.AuditPage, errors=(400,)))
    async def list_events(
        self, service: AuditService,
        limit: Annotated[int, Parameter(ge=1, le=MAX_PAGE)] = 100,
        offset: Annotated[int, Parameter(ge=0, le=MAX_OFFSET)] = 0,
        # not Optional: Litestar documents `X | None` as a oneOf whose constraints sit beside it
        adapter: Annotated[str, Parameter(max_length=256, pattern=_NO_NUL, description="rows on this adapter (its name, or "
                                          "name@version); empty: any")] = "",
        actor: Annotated[str, Parameter(max_length=256, pattern=_NO_NUL, description="the caller as the rows name "
                                        "it: role:name, e.g. admin:ops or engine:local-1")] = "",
        action: Annotated[str, Parameter(max_length=64, pattern=_NO_NUL, description="e.g. load_lora_adapter")] = "",
        # a string checked here (the framework's datetime would take a bare number, since=0.5, as a time);
        # Optional, as a default "" would have to pass min_length: left out is any time, since= a 400
        since: Annotated[str | None, Parameter(min_length=20, max_length=64, pattern=_RFC3339,
                                        schema_extra={"format": "date-time"},
                                        description="rows at or after this time (RFC 3339, with its offset)")] = None,
    ) -> schemas.AuditPage:
        """A page of the audit trail, newest first: every mutating call, done or refused, with its actor
        (`role:name`: the token's or key's name, else a short sha256 prefix of the token; never the token),
        action, target and outcome; filtered by
        adapter, actor, action and time (400 for a time that is not RFC 3339)."""
        query = AuditQuery(limit=limit, offset=offset, adapter=adapter or None, actor=actor or None,
                           action=action or None, since=as_utc(parse_time(since or "", "since")))
        return await service.page(query)
