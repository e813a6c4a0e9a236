"""HTTP surface of the engines registry: thin handlers, one service call each.

Engines started with `--control-plane URL --control-plane-token T` register and heartbeat themselves;
an operator may also register one by hand. Names may contain `/`, so per-engine routes take the rest of
the path; the heartbeat is matched as a path that ends in `/heartbeat`.
"""

from __future__ import annotations

from litestar import Controller, delete, get, post
from litestar.datastructures import State
from litestar.di import Provide
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.auth import Principal, admin_guard, provide_principal, read_guard
from control_plane.domain.engines import schemas
from control_plane.domain.engines.service import EngineService
from control_plane.uow import Mutation
from shared.errors import NotFoundError

_HEARTBEAT = "/heartbeat"


async def provide_engine_service(db_session: AsyncSession, state: State) -> EngineService:
    mutation = Mutation(db_session, state.write_gate, state.metrics)
    return EngineService(db_session, state.settings, mutation, state.write_gate, state.reconciler)


class EngineController(Controller):
    path = "/v1/engines"
    tags = ["engines"]
    guards = [read_guard]
    dependencies = {"service": Provide(provide_engine_service), "principal": Provide(provide_principal)}

    @post("/register", status_code=200, guards=[admin_guard], operation_id="registerEngine",
          opt={"audit_action": "register_engine"})
    async def register(self, service: EngineService, principal: Principal,
                       data: schemas.EngineCreate) -> schemas.Engine:
        """Register an engine (idempotent by name: a repeat updates its url, base model and slots); it is
        healthy from now on for as long as it heartbeats."""
        return await service.register(data, principal)

    @post("/reconcile", status_code=200, guards=[admin_guard], operation_id="reconcileEngines",
          opt={"audit_action": "reconcile_engines"})
    async def reconcile(self, service: EngineService, principal: Principal) -> schemas.ReconcileReport:
        """Reconcile every healthy engine now (the reconciler also runs every `reconcile_interval_s` and
        after an engine registers): load what its placements desire and it lacks, unload what it should
        not hold, record what each engine answered."""
        return await service.reconcile(principal)

    @post("/{target:path}", status_code=200, guards=[admin_guard], operation_id="engineHeartbeat",
          opt={"audit_action": "engine_heartbeat"})
    async def heartbeat(self, service: EngineService, target: str, data: schemas.EngineHeartbeat) -> schemas.Engine:
        """`/v1/engines/{name}/heartbeat`: the engine is alive (404 if unknown: register again). An engine
        that misses heartbeats for `engine_stale_after_s` reads as unhealthy and gets no new placements."""
        target = target.lstrip("/")
        if not target.endswith(_HEARTBEAT) or len(target) == len(_HEARTBEAT):
            raise NotFoundError(f"No route for POST /v1/engines/{target}; did you mean …/{target}/heartbeat?")
        return await service.heartbeat(target.removesuffix(_HEARTBEAT), data)

    @get("/", operation_id="listEngines")
    async def list_engines(self, service: EngineService) -> schemas.EngineList:
        """Every registered engine with its health (missed heartbeats read as unhealthy) and slots."""
        return await service.list()

    @delete("/{name:path}", status_code=200, guards=[admin_guard], operation_id="deleteEngine",
            opt={"audit_action": "delete_engine"})
    async def delete_engine(self, service: EngineService, principal: Principal, name: str) -> schemas.EngineDeleted:
        """Forget an engine and its placements (the engine itself keeps running and may register again)."""
        return await service.delete(name.lstrip("/"), principal)
