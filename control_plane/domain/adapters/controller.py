"""HTTP surface of the adapter registry: thin handlers, one service call each.

Adapter names may contain `/` (e.g. `org/adapter`), so per-adapter routes take the rest of the path;
`POST /v1/lora_adapters/{name}/activate` is matched as a path that ends in `/activate`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
from litestar import Controller, Request, Response, delete, get, patch, post, route
from litestar.datastructures import State
from litestar.di import Provide
from litestar.params import Parameter
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.auth import Principal, admin_guard, provide_principal, read_guard, require_engine
from control_plane.db.paging import MAX_OFFSET
from control_plane.domain.adapters import schemas
from control_plane.domain.adapters.queries import MAX_PAGE, NO_OWNER, AdapterQuery, Visibility
from control_plane.domain.adapters.service import AdapterService
from control_plane.domain.placements.planner import PlacementPlanner
from control_plane.domain.placements.push import Pusher
from control_plane.uow import Mutation
from shared.errors import InvalidRequestError, NotFoundError
from shared.names import AdapterName, name_problem
from shared.openapi import (
    decode_body,
    method_not_allowed,
    options_response,
    refuse_undocumented_method,
    route_doc,
    route_docs,
)
from shared.tenants import TENANT_NAME_PATTERN

_ACTIVATE = "/activate"
_VERSIONS = "/versions"
_VERSION_PATH = re.compile(r"^(?P<name>.+)/versions/(?P<number>\d{1,9})$")
_FIELDS = {
    "base_model": {"type": "string", "maxLength": 256, "description": "needed when adapter_config.json names none"},
    "description": {"type": "string", "maxLength": 4096},
    "activate": {"type": "boolean", "default": True, "description": "pin the new version and place it"},
    "pinned": {"type": "boolean", "default": False},
    "replicas": {"type": "string", "maxLength": 256,
                 "description": 'JSON: {"min": N, "max": N or "all"}; left out: the defaults'},
}
_UPLOAD_CONTENT = {
    "multipart/form-data": {"schema": {
        "type": "object", "required": ["files"],
        "properties": {"files": {"type": "array", "items": {"type": "string", "format": "binary"},
                                 "description": "one part per file, its filename the file's name: "
                                 "adapter_config.json and adapter_model.safetensors"}, **_FIELDS}}},
    "application/gzip": {"schema": {"type": "string", "format": "binary",
                                    "description": "a .tar.gz of the two files (the fields as query parameters)"}},
}
# Every route may also answer 401/403 (its guards) and 503 (the database is unavailable): the app adds
# those (control_plane.app); here each route lists what its own handler and service raise.
_PUSH = (207, 502)  # a push answers the success body with these when some / all engines failed
_MUTATION_ERRORS = (400, 404, 409, 413)
_NAME = {"name": AdapterName}
_OWNER_FILTER = f"^({TENANT_NAME_PATTERN.strip('^$')}|{NO_OWNER})?$"
_TENANT_ROLE = {"tenant_role": "adapter"}  # a tenant key with admin:<tenant> may call it on its tenant's adapters


async def provide_adapter_service(db_session: AsyncSession, state: State) -> AdapterService:
    mutation = Mutation(db_session, state.write_gate, state.metrics)
    planner = PlacementPlanner.of(state.settings)
    pusher = Pusher(state.version_loader, db_session, state.write_gate, state.metrics)
    return AdapterService(db_session, state.settings, mutation, planner, pusher, state.artifact_store)


class AdapterController(Controller):
    path = "/v1"
    tags = ["adapters"]
    guards = [read_guard]
    dependencies = {"service": Provide(provide_adapter_service), "principal": Provide(provide_principal)}
    before_request = staticmethod(refuse_undocumented_method)  # a hook, not a method (Litestar reads either)

    @post("/load_lora_adapter", status_code=200, guards=[admin_guard], operation_id="loadLoraAdapter",
          opt={"audit_action": "load_lora_adapter", **_TENANT_ROLE,
               **route_doc(request=schemas.AdapterCreate, response=schemas.AdapterLoaded, alternates=_PUSH,
                           errors=_MUTATION_ERRORS, example={"lora_name": "org/adapter",
                                                             "lora_path": "/srv/adapters/org/adapter"})})
    async def load(self, service: AdapterService, principal: Principal,
                   request: Request[Any, Any, Any]) -> Response[schemas.AdapterLoaded]:
        """Register an adapter folder and pin it as the active version (idempotent), then push it.

        The files are validated (config, rank, targets, safetensors header, location under the adapter
        roots) before anything is recorded. From a tenant key, `lora_path` must also lie under one of its
        tenant's `sources` (403 otherwise, before anything is read; such a key may always upload). Identical files return the existing version (`created`
        false); new files become the next version. The version is desired where the replica rules put
        it — the engines holding the adapter now, and more chosen by rendezvous hashing over free
        capacity until `replicas.min` (or demand scaling's target) healthy engines of its base model
        hold it — or exactly on the named `engines`, and pushed to them concurrently; `engines` in the
        answer says how each did. When no engine serves the base model yet (or none is healthy),
        `engines` is empty and `warning` says so: the adapter is placed as soon as one registers.
        Status: 200 all engines loaded it (or none was involved), 207 some failed, 502 all failed — the
        version is recorded and pinned in every case.
        """
        loaded = await service.load(decode_body(await request.body(), schemas.AdapterCreate), principal)
        return Response(loaded, status_code=schemas.push_status(loaded.engines))

    @post("/unload_lora_adapter", status_code=200, guards=[admin_guard], operation_id="unloadLoraAdapter",
          opt={"audit_action": "unload_lora_adapter", **_TENANT_ROLE,
               **route_doc(request=schemas.AdapterUnload, response=schemas.AdapterUnloaded, alternates=_PUSH,
                           errors=_MUTATION_ERRORS)})
    async def unload(self, service: AdapterService, principal: Principal,
                     request: Request[Any, Any, Any]) -> Response[schemas.AdapterUnloaded]:
        """Desire the adapter absent on every engine and tell them (they drain in-flight requests); the
        registry keeps its versions. Status as for loads: 200, 207 (some engines failed), 502 (all)."""
        unloaded = await service.unload(decode_body(await request.body(), schemas.AdapterUnload), principal)
        return Response(unloaded, status_code=schemas.push_status(unloaded.engines))

    @get("/lora_adapters", operation_id="listLoraAdapters", opt=route_doc(response=schemas.AdapterPage, errors=(400,)))
    async def list_adapters(
        self, service: AdapterService,
        limit: Annotated[int, Parameter(ge=1, le=MAX_PAGE)] = 100,
        offset: Annotated[int, Parameter(ge=0, le=MAX_OFFSET)] = 0,
        # not Optional: Litestar documents `X | None` as a oneOf whose constraints sit beside it
        base_model: Annotated[str, Parameter(max_length=256, description="empty: any")] = "",
        name_prefix: Annotated[str, Parameter(max_length=128)] = "",
        label: Annotated[tuple[schemas.LabelFilter, ...], Parameter(
            description="key=value or key; repeat to AND", max_items=schemas.MAX_LABELS,
            schema_extra={"items": msgspec.json.schema(schemas.LabelFilter)})] = (),
        owner: Annotated[str, Parameter(pattern=_OWNER_FILTER, description=(
            f"a tenant's name: the adapters it owns; `{NO_OWNER}`: those no tenant owns; empty: any"))] = "",
        visibility: Visibility = "any",
    ) -> schemas.AdapterPage:
        """A page of registered adapters ordered by name, filtered by base model, name prefix, labels, owner
        tenant and visibility (public: every tenant's keys may use it; private: its owner's only)."""
        query = AdapterQuery(limit=limit, offset=offset, base_model=base_model or None,
                             name_prefix=name_prefix or None, labels=list(label), owner=owner or None,
                             visibility=visibility)
        return await service.list(query)

    @get("/lora_adapters/{name:path}", operation_id="getLoraAdapter",
         opt={**_TENANT_ROLE, **route_doc(response=schemas.AdapterDetail, errors=(400, 404),
                                          path="/v1/lora_adapters/{name}", path_params=_NAME)})
    async def get_adapter(self, service: AdapterService, name: str) -> schemas.AdapterDetail:
        """One adapter with all its versions and its placements on engines."""
        return await service.get(name.lstrip("/"))

    @patch("/lora_adapters/{name:path}", guards=[admin_guard], operation_id="updateLoraAdapter",
           opt={"audit_action": "update_lora_adapter", **_TENANT_ROLE,
                **route_doc(request=schemas.AdapterUpdate, response=schemas.AdapterUpdated, alternates=_PUSH,
                            errors=(400, 404, 409), path="/v1/lora_adapters/{name}", path_params=_NAME,
                            example={"replicas": {"min": 1, "max": 2}, "pinned": True})})
    async def update_adapter(self, service: AdapterService, principal: Principal, name: str,
                             request: Request[Any, Any, Any]) -> Response[Any]:
        """Set the adapter's `replicas {min, max}`, `pinned` and/or `base_model` (at least one; one left out
        is kept; unknown fields are a 400 naming them).

        `replicas` (`max` may be "all"; a field left out or null is the control plane's default; 400 when
        min is above max): replicas are added or let go at once to meet the new counts (never a loaded
        one that would leave fewer than desired loaded), and demand scaling moves between them from now
        on. `pinned`: every engine holding the adapter keeps it in a device slot, never evicted (true) or
        may evict it again (false); they are told at once, and replicas added later follow (409 when no
        engine is to hold it). `base_model` re-targets the adapter (an admin token only: 403 for a tenant
        key; 400 when the adapter is named like a base model): engines that do not serve the new base model
        are told to unload it and its placements there are removed, and the active version is placed on
        engines of the new base model as a load places it (`warning` says when none can take it yet).
        Audited as retarget_lora_adapter (detail: `from` and `to` base model) when `base_model` is given,
        as pin_lora_adapter / unpin_lora_adapter when only `pinned` is. Status as for loads: 200, 207
        (some engines failed), 502 (all)."""
        target = name.lstrip("/")
        if target.endswith((_ACTIVATE, _VERSIONS)) or _VERSION_PATH.match(target):
            return method_not_allowed(request)  # …/activate, …/versions[/n]: no adapter has such a name
        data = decode_body(await request.body(), schemas.AdapterUpdate)
        updated = await service.update(target, data, principal)
        return Response(updated, status_code=schemas.push_status(updated.engines))

    @get("/resolve/{name:path}", operation_id="resolveLoraAdapter",
         opt={"engine_role": True, **route_doc(response=schemas.AdapterResolved, errors=(400, 404),
                                               path="/v1/resolve/{name}", path_params=_NAME)})
    async def resolve(self, service: AdapterService, principal: Principal, name: str,
                      base_model: str | None = None, engine: str | None = None) -> schemas.AdapterResolved:
        """What an engine should load to serve `model` = `name`: the active version's folder and sha256
        (404 when no such adapter is registered for `base_model`, or it was unloaded; 400 for a name the
        name rule refuses; `/` may come quoted as `%2F`). Engines call it for an unknown `model` with
        their engine token, which records the placement on that engine (an admin token does so for the
        engine named in `engine`)."""
        name = name.removeprefix("/")  # the path parameter's own leading slash, once
        problem = name_problem(name)
        if problem is not None:
            raise InvalidRequestError(f"invalid adapter name: {problem}", param="name")
        if principal.kind == "engine":
            require_engine(principal, engine or str(principal.engine))
            engine = principal.engine
        return await service.resolve(name, base_model, engine, principal)

    @post("/lora_adapters/{name:path}", status_code=200, guards=[admin_guard], operation_id="activateOrUpload",
          request_max_body_size=None,  # an upload's own cap is --max-artifact-bytes (control_plane.artifacts.upload)
          opt={"audit_action": "activate_or_upload_lora_adapter", **_TENANT_ROLE, **route_docs(
              route_doc(request=schemas.AdapterActivate, response=schemas.AdapterActivated, alternates=_PUSH,
                        errors=_MUTATION_ERRORS, path="/v1/lora_adapters/{name}/activate", path_params=_NAME,
                        operation_id="activateLoraAdapter"),
              route_doc(request_content=_UPLOAD_CONTENT, response=schemas.AdapterLoaded, alternates=_PUSH,
                        errors=(*_MUTATION_ERRORS, 408), path="/v1/lora_adapters/{name}/versions", path_params=_NAME,
                        operation_id="uploadLoraAdapterVersion"))})
    async def activate_or_upload(self, service: AdapterService, principal: Principal, name: str,
                                 request: Request[Any, Any, Any]
                                 ) -> Response[schemas.AdapterActivated | schemas.AdapterLoaded]:
        """`/v1/lora_adapters/{name}/activate`: make an existing version the pin, to roll back or forward.
        Engines holding the adapter load the version in place: new requests get it at once, in-flight
        ones finish on the old.

        `/v1/lora_adapters/{name}/versions`: upload a version's files, as `multipart/form-data` (one part
        per file, named by its filename: adapter_config.json, adapter_model.safetensors; fields
        base_model, description, activate (default true), pinned) or as a `.tar.gz` body (fields as query
        parameters). The body is streamed into the artifact store, capped by --max-artifact-bytes (413),
        and validated like a load's folder before anything is recorded; the answer is a load's.

        Status of both as for loads: 200, 207 (some engines failed), 502 (all)."""
        target = name.lstrip("/")
        for suffix in (_ACTIVATE, _VERSIONS):
            if target.endswith(suffix) and len(target) > len(suffix):
                adapter = target.removesuffix(suffix)
                if suffix == _VERSIONS:
                    loaded = await service.upload(adapter, request, principal)
                    return Response(loaded, status_code=schemas.push_status(loaded.engines))
                data = decode_body(await request.body(), schemas.AdapterActivate)
                activated = await service.activate(adapter, data, principal)
                return Response(activated, status_code=schemas.push_status(activated.engines))
        raise NotFoundError(f"No route for POST /v1/lora_adapters/{target}; did you mean …/{target}/activate "
                            "or …/{target}/versions?")

    @delete("/lora_adapters/{name:path}", status_code=200, guards=[admin_guard], operation_id="deleteLoraAdapterOrVersion",
            opt={"audit_action": "delete_lora_adapter", **_TENANT_ROLE, **route_docs(
                route_doc(response=schemas.AdapterDeleted, errors=(400, 404, 409), path="/v1/lora_adapters/{name}",
                          path_params=_NAME, operation_id="deleteLoraAdapter"),
                route_doc(response=schemas.VersionDeleted, errors=(400, 404, 409),
                          path="/v1/lora_adapters/{name}/versions/{version}",
                          path_params={**_NAME, "version": Annotated[int, msgspec.Meta(ge=1, le=schemas.MAX_VERSION)]},
                          operation_id="deleteLoraAdapterVersion"))})
    async def delete_adapter_or_version(self, service: AdapterService, principal: Principal,
                                        name: str) -> schemas.AdapterDeleted | schemas.VersionDeleted:
        """`/v1/lora_adapters/{name}`: remove an adapter and all its versions; refused (409) while any
        engine should still hold it.

        `/v1/lora_adapters/{name}/versions/{version}`: remove one version that is neither the active one
        nor placed on an engine (409 otherwise). Either way, blobs that no remaining version lists leave
        the artifact store."""
        target = name.lstrip("/")
        version = _VERSION_PATH.match(target)
        if version is not None:
            number = int(version["number"])
            if not 1 <= number <= schemas.MAX_VERSION:
                raise InvalidRequestError(f"version must be 1..{schemas.MAX_VERSION}", param="version")
            return await service.delete_version(version["name"], number, principal)
        return await service.delete(target, principal)

    @route("/lora_adapters/{name:path}", http_method="OPTIONS", include_in_schema=False)
    async def _options(self, request: Request[Any, Any, Any]) -> Response[None]:
        """The methods documented for this path (one route serves several documented paths). Named to
        sort first: Litestar gives the first handler registered on a path its own OPTIONS, which wins."""
        return options_response(request)
