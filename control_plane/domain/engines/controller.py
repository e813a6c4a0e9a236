"""HTTP surface of the engines registry: thin handlers, one service call each.

Engines started with `--control-plane URL` and LORAPLANE_CONTROL_PLANE_TOKEN register, heartbeat and
drain themselves with their engine token (LORAPLANE_ENGINE_CREDENTIALS: valid for their own name only);
an operator may also register one by hand with an admin token. Names may contain `/`, so per-engine
routes take the rest of the path; heartbeat and drain are matched as paths ending in `/heartbeat`, `/drain`.
"""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, delete, get, post, route
from litestar.datastructures import State
from litestar.di import Provide
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.auth import Principal, admin_guard, engine_guard, provide_principal, read_guard
from control_plane.domain.engines import schemas
from control_plane.domain.engines.service import EngineService
from control_plane.uow import Mutation
from shared.engine_admin import Name
from shared.errors import NotFoundError
from shared.openapi import decode_body, options_response, route_doc, route_docs

_HEARTBEAT = "/heartbeat"
_DRAIN = "/drain"
_ENGINE_ROLE = {"engine_role": True}  # an engine token may call it, for its own name
_NAME = {"name": Name}
# The app adds 401/403 (guards) and 503 (database unavailable) to every route (control_plane.app).
_BEAT = route_doc(request=schemas.EngineHeartbeat, request_required=False, response=schemas.Engine,
                  errors=(400, 404, 409, 413), path="/v1/engines/{name}/heartbeat", path_params=_NAME,
                  operation_id="engineHeartbeat")
_DRAIN_DOC = route_doc(response=schemas.Engine, errors=(400, 404, 409), path="/v1/engines/{name}/drain",
                       path_params=_NAME, operation_id="drainEngine")


async def provide_engine_service(db_session: AsyncSession, state: State) -> EngineService:
    mutation = Mutation(db_session, state.write_gate, state.metrics)
    return EngineService(db_session, state.settings, mutation, state.write_gate, state.reconciler_hooks)


class EngineController(Controller):
    path = "/v1/engines"
    tags = ["engines"]
    guards = [read_guard]
    dependencies = {"service": Provide(provide_engine_service), "principal": Provide(provide_principal)}

    @post("/register", status_code=200, guards=[engine_guard], operation_id="registerEngine",
          opt={"audit_action": "register_engine", **_ENGINE_ROLE,
               **route_doc(request=schemas.EngineCreate, response=schemas.Engine, errors=(400, 409, 413),
                           example={"name": "engine-1", "url": "http://10.0.0.7:8000", "base_model": "demo",
                                    "slots_total": 4})})
    async def register(self, service: EngineService, principal: Principal,
                       request: Request[Any, Any, Any]) -> schemas.Engine:
        """Register an engine (idempotent by name: a repeat updates everything it registers: its kind
        (`loraplane`, or `vllm` behind `loraplane agent`), url, inference url (`inference_url`: where
        routers send inference when that is not `url`, as for an agent whose engine serves it), served
        base model, the other names its base model goes by (`model_name_or_path`, `model_path`,
        `config_digest`: an adapter's base model matches any of them), device, capacities and context
        length (`max_model_len`, which the routing table carries for routers' token reservations); it is
        healthy from now on for as long as it heartbeats. An admin token registers any name, an engine
        token only its own. The url (and the inference url) must be `http(s)://host[:port]`: no
        userinfo, query, fragment or path, no link-local or cloud-metadata address, inside
        LORAPLANE_ENGINE_ALLOWED_NETWORKS when set (400 `invalid_engine_url` naming the field and the
        problem)."""
        return await service.register(decode_body(await request.body(), schemas.EngineCreate), principal)

    @post("/reconcile", status_code=200, guards=[admin_guard], operation_id="reconcileEngines",
          opt={"audit_action": "reconcile_engines", **route_doc(response=schemas.ReconcileReport)})
    async def reconcile(self, service: EngineService, principal: Principal) -> schemas.ReconcileReport:
        """Reconcile every healthy engine now (the reconciler also runs every `reconcile_interval_s` and
        after an engine registers): load what its placements desire and it lacks, unload what it should
        not hold, record what each engine answered."""
        return await service.reconcile(principal)

    @post("/{name:path}", status_code=200, guards=[engine_guard], operation_id="engineHeartbeatOrDrain",
          opt={"audit_action": "engine_heartbeat_or_drain", **_ENGINE_ROLE, **route_docs(_BEAT, _DRAIN_DOC)})
    async def heartbeat_or_drain(self, service: EngineService, principal: Principal, name: str,
                                 request: Request[Any, Any, Any]) -> schemas.Engine:
        """`/v1/engines/{name}/heartbeat`: the engine is alive (404 if unknown: register again), and
        whether it is `healthy` and `draining`: either makes it get no new placements at once, as does
        missing heartbeats for `engine_stale_after_s`.

        `/v1/engines/{name}/drain` (no body; audited): the engine is shutting down; it gets no new
        placements until it registers again. The engine's own token or an admin token."""
        target = name.lstrip("/")  # the server percent-decoded the path once: `%2F` is `/` here
        for suffix in (_HEARTBEAT, _DRAIN):
            if target.endswith(suffix) and len(target) > len(suffix):
                name = target.removesuffix(suffix)
                if suffix == _DRAIN:
                    return await service.drain(name, principal)
                body = await request.body()  # optional: an empty heartbeat says only "alive"
                data = decode_body(body, schemas.EngineHeartbeat) if body.strip() else schemas.EngineHeartbeat()
                return await service.heartbeat(name, data, principal)
        raise NotFoundError(f"No route for POST /v1/engines/{target}; did you mean …/{target}/heartbeat or /drain?")

    @get("/", operation_id="listEngines", opt=route_doc(response=schemas.EngineList))
    async def list_engines(self, service: EngineService) -> schemas.EngineList:
        """Every registered engine with its health (missed heartbeats read as unhealthy) and slots."""
        return await service.list()

    @delete("/{name:path}", status_code=200, guards=[admin_guard], operation_id="deleteEngine",
            opt={"audit_action": "delete_engine",
                 **route_doc(response=schemas.EngineDeleted, errors=(400, 404), path="/v1/engines/{name}",
                             path_params=_NAME)})
    async def delete_engine(self, service: EngineService, principal: Principal, name: str) -> schemas.EngineDeleted:
        """Forget an engine and its placements (the engine itself keeps running and may register again)."""
        return await service.delete(name.lstrip("/"), principal)

    @route("/{name:path}", http_method="OPTIONS", include_in_schema=False)
    async def _options(self, request: Request[Any, Any, Any]) -> Response[None]:
        """The methods documented for this path (one route serves several documented paths). Named to
        sort first: Litestar gives the first handler registered on a path its own OPTIONS, which wins."""
        return options_response(request)
