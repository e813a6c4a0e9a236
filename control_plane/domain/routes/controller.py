"""HTTP surface of the routing table (shared/routes.py is the contract with the router): thin handlers.

`GET /v1/routes` takes a router, read or admin token; `POST /v1/routes/demand` a router or admin token
(control_plane.auth.router_guard). A router token may call nothing else.
"""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.datastructures import State
from litestar.di import Provide
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.auth import Principal, provide_principal, router_guard
from control_plane.domain.placements.planner import PlacementPlanner
from control_plane.domain.placements.push import Pusher
from control_plane.domain.routes.service import RoutesService
from control_plane.uow import Mutation
from shared.openapi import decode_body, route_doc
from shared.routes import DEMAND_PATH, ROUTES_PATH, DemandAnswer, DemandReport, RoutesTable

_JSON = "application/json"


async def provide_routes_service(db_session: AsyncSession, state: State) -> RoutesService:
    gate = state.write_gate
    return RoutesService(db_session, state.settings, Mutation(db_session, gate, state.metrics), gate,
                         PlacementPlanner.of(state.settings),
                         Pusher(state.version_loader, db_session, gate, state.metrics), state.routes_cache)


class RoutesController(Controller):
    path = ROUTES_PATH
    tags = ["routes"]
    guards = [router_guard]
    dependencies = {"service": Provide(provide_routes_service), "principal": Provide(provide_principal)}

    @get("/", operation_id="getRoutes", opt=route_doc(
        response=RoutesTable, bodiless=(304,),
        response_description="The routing table; its `ETag` header (a strong validator) equals `etag`."))
    async def routes(self, service: RoutesService, request: Request[Any, Any, Any]) -> Response[bytes]:
        """The routing table: the healthy engines, and for every base model and every servable adapter
        the engines that hold it with their residency (`device` > `host` > `loading`). Send the ETag back
        in `If-None-Match`: 304 with no body while the table is unchanged."""
        table = await service.table()
        headers = {"ETag": table.etag, "Cache-Control": "no-cache"}
        if table.matches(request.headers.get("if-none-match")):
            return Response(b"", status_code=304, headers=headers)
        return Response(table.body, media_type=_JSON, headers=headers)

    @post(DEMAND_PATH.removeprefix(ROUTES_PATH), status_code=200, operation_id="reportDemand",
          opt={"audit_action": "report_demand",
               **route_doc(request=DemandReport, response=DemandAnswer, errors=(400, 413),
                           example={"demand": [{"model": "org/adapter", "waiting": 3, "running": 8}],
                                    "place": ["org/adapter"]})})
    async def demand(self, service: RoutesService, principal: Principal,
                     request: Request[Any, Any, Any]) -> DemandAnswer:
        """A router's per-model queue figures (they feed demand scaling) and the adapters it has requests
        for that nobody holds (`place`): each is placed now and pushed to its engines before the answer,
        which carries their routes; names that are no servable adapter come back in `unknown`."""
        return await service.report(decode_body(await request.body(), DemandReport), principal)
