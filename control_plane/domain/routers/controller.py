"""GET /v1/routers: the routers that reported, one thin handler (read or admin token)."""

from __future__ import annotations

from litestar import Controller, get
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.auth import read_guard
from control_plane.domain.routers import schemas
from control_plane.domain.routers.service import list_routers
from shared.openapi import route_doc


class RouterController(Controller):
    path = "/v1/routers"
    tags = ["routers"]
    guards = [read_guard]

    @get("/", operation_id="listRouters", opt=route_doc(response=schemas.RouterList))
    async def list(self, db_session: AsyncSession) -> schemas.RouterList:
        """The routers that reported to this control plane (with their demand reports, at least every
        few seconds): `up` while they report, `stale` once silent for `stale_after_s`; forgotten after a
        day of silence."""
        return await list_routers(db_session)
