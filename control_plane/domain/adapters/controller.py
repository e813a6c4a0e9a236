"""HTTP surface of the adapter registry: thin handlers, one service call each.

Adapter names may contain `/` (e.g. `org/adapter`), so per-adapter routes take the rest of the path;
`POST /v1/lora_adapters/{name}/activate` is matched as a path that ends in `/activate`.
"""

from __future__ import annotations

from typing import Annotated

from litestar import Controller, delete, get, post
from litestar.datastructures import State
from litestar.di import Provide
from litestar.params import Parameter
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.auth import Principal, admin_guard, provide_principal, read_guard
from control_plane.domain.adapters import schemas
from control_plane.domain.adapters.placement import PlacementPlanner
from control_plane.domain.adapters.queries import MAX_PAGE, AdapterQuery
from control_plane.domain.adapters.service import AdapterService
from control_plane.uow import Mutation
from shared.errors import NotFoundError

_ACTIVATE = "/activate"


async def provide_adapter_service(db_session: AsyncSession, state: State) -> AdapterService:
    mutation = Mutation(db_session, state.write_gate, state.metrics)
    return AdapterService(db_session, state.settings, mutation, PlacementPlanner())


class AdapterController(Controller):
    path = "/v1"
    tags = ["adapters"]
    guards = [read_guard]
    dependencies = {"service": Provide(provide_adapter_service), "principal": Provide(provide_principal)}

    @post("/load_lora_adapter", status_code=200, guards=[admin_guard], operation_id="loadLoraAdapter",
          opt={"audit_action": "load_lora_adapter"})
    async def load(self, service: AdapterService, principal: Principal,
                   data: schemas.AdapterCreate) -> schemas.AdapterLoaded:
        """Register an adapter folder and pin it as the active version (idempotent).

        The files are validated (config, rank, targets, safetensors header, location under the adapter
        roots) before anything is recorded. Identical files return the existing version (`created`
        false); new files become the next version. The version is desired on every healthy engine of
        the adapter's base model, or on the named `engines`.
        """
        return await service.load(data, principal)

    @post("/unload_lora_adapter", status_code=200, guards=[admin_guard], operation_id="unloadLoraAdapter",
          opt={"audit_action": "unload_lora_adapter"})
    async def unload(self, service: AdapterService, principal: Principal,
                     data: schemas.AdapterUnload) -> schemas.AdapterUnloaded:
        """Desire the adapter absent on every engine; the registry keeps its versions."""
        return await service.unload(data, principal)

    @get("/lora_adapters", operation_id="listLoraAdapters")
    async def list_adapters(
        self, service: AdapterService,
        limit: Annotated[int, Parameter(ge=1, le=MAX_PAGE)] = 100,
        offset: Annotated[int, Parameter(ge=0)] = 0,
        base_model: str | None = None,
        name_prefix: str | None = None,
        label: Annotated[list[str] | None, Parameter(description="key=value or key; repeat to AND")] = None,
    ) -> schemas.AdapterPage:
        """A page of registered adapters ordered by name, filtered by base model, name prefix and labels."""
        query = AdapterQuery(limit=limit, offset=offset, base_model=base_model, name_prefix=name_prefix,
                             labels=label or [])
        return await service.list(query)

    @get("/lora_adapters/{name:path}", operation_id="getLoraAdapter")
    async def get_adapter(self, service: AdapterService, name: str) -> schemas.AdapterDetail:
        """One adapter with all its versions and its placements on engines."""
        return await service.get(name.lstrip("/"))

    @post("/lora_adapters/{target:path}", status_code=200, guards=[admin_guard], operation_id="activateLoraAdapter",
          opt={"audit_action": "activate_lora_adapter"})
    async def activate(self, service: AdapterService, principal: Principal, target: str,
                       data: schemas.AdapterActivate) -> schemas.AdapterDetail:
        """Make an existing version the pin (`/v1/lora_adapters/{name}/activate`): roll back or forward."""
        target = target.lstrip("/")
        if not target.endswith(_ACTIVATE) or len(target) == len(_ACTIVATE):
            raise NotFoundError(f"No route for POST /v1/lora_adapters/{target}; did you mean …/{target}/activate?")
        return await service.activate(target.removesuffix(_ACTIVATE), data, principal)

    @delete("/lora_adapters/{name:path}", status_code=200, guards=[admin_guard], operation_id="deleteLoraAdapter",
            opt={"audit_action": "delete_lora_adapter"})
    async def delete_adapter(self, service: AdapterService, principal: Principal,
                             name: str) -> schemas.AdapterDeleted:
        """Remove an adapter and all its versions; refused (409) while any engine should still hold it."""
        return await service.delete(name.lstrip("/"), principal)
