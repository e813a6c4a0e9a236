"""AdapterService: the registry's rules. Controllers make one call here; every change goes through
control_plane.uow.Mutation (one transaction + audit row, retried when a concurrent call wins a race, on
deadlocks and on a database connection lost before the commit)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shlex
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Request
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.artifacts import blobs, upload
from control_plane.artifacts.inspect import InspectedAdapter
from control_plane.artifacts.sources import is_object_store_url, spool_source
from control_plane.artifacts.spool import Spool, spool_root
from control_plane.artifacts.store import ArtifactStore
from control_plane.auth import Principal
from control_plane.db.models import Adapter, AdapterVersion, DesiredState
from control_plane.db.transaction import read, transact
from control_plane.domain.adapters import base_models, pinning, queries, removal, schemas
from control_plane.domain.placements.planner import (
    PlacementPlanner,
    PushOrder,
    in_store,
)
from control_plane.domain.placements.push import EngineOutcome, Pusher
from control_plane.domain.placements.replicas import ReplicaDefaults, ReplicaRule
from control_plane.domain.tenants import service as tenant_rules
from control_plane.domain.tenants import sources as tenant_sources
from control_plane.settings import ControlPlaneSettings
from control_plane.uow import Mutation
from shared.errors import ConflictError, InvalidRequestError, NotFoundError, PermissionDeniedError
from shared.names import name_problem


@dataclass
class Incoming:
    """A version on its way in: its spooled files, what validating them found, and how to record it."""

    spool: Spool
    found: InspectedAdapter
    req: schemas.AdapterCreate
    activate: bool = True


class AdapterService:
    def __init__(self, session: AsyncSession, settings: ControlPlaneSettings, mutation: Mutation,
                 planner: PlacementPlanner, pusher: Pusher, store: ArtifactStore) -> None:
        self.session = session
        self.settings = settings
        self.mutation = mutation
        self.planner = planner
        self.pusher = pusher
        self.store = store

    async def load(self, req: schemas.AdapterCreate, actor: Principal) -> schemas.AdapterLoaded:
        """Validate the files, copy them into the artifact store, create or reuse the version, pin it,
        record where it should be placed; after the commit, push it to those engines and answer with
        each one's outcome. A tenant key's lora_path must lie under its tenant's sources (403)."""

        async def spool() -> Incoming:
            roots = self.settings.adapter_roots
            tenant = actor.tenant
            if tenant is not None:  # a tenant key reads only under its tenant's sources
                sources = await read(self.session, lambda: tenant_rules.sources_of(self.session, tenant),
                                     f"sources of {tenant!r}")
                await self.session.commit()  # end the read: the copy may take long, holding no transaction
                roots = await asyncio.to_thread(tenant_sources.confine, req.lora_path, sources, roots, tenant)
            spooled, found = await spool_source(req.lora_path, roots, self.settings.max_artifact_bytes,
                                                spool_root(self.settings.data_dir))
            return Incoming(spooled, dataclasses.replace(found, path=_source_of(req.lora_path, found)), req)

        return await self.record_version("load_lora_adapter", req.lora_name, actor, spool)

    async def upload(self, name: str, request: Request[Any, Any, Any], actor: Principal) -> schemas.AdapterLoaded:
        """POST /v1/lora_adapters/{name}/versions: the body's files (multipart or .tar.gz) become a version
        as a load's folder does; `activate` (default true) pins and places it, as a load does."""
        _refuse_route_names(name)

        async def spool() -> Incoming:
            received = await upload.receive(request, self.settings.max_artifact_bytes,
                                            request.query_params.multi_items(), self.settings.upload_idle_timeout_s,
                                            spool_root(self.settings.data_dir))
            try:
                req, activate = upload_request(name, received.fields)
                found = await asyncio.to_thread(received.spool.inspect)
            except BaseException:
                received.spool.close()
                raise
            return Incoming(received.spool, dataclasses.replace(found, path="upload"), req, activate)

        return await self.record_version("upload_lora_adapter", name, actor, spool)

    async def record_version(self, action: str, name: str, actor: Principal,
                             receive: Callable[[], Awaitable[Incoming]]) -> schemas.AdapterLoaded:
        """The rest of every way in (load, upload): the spooled files go into the store (before the
        transaction: the slow part), then the version and its manifest are recorded in one transaction
        with the audit row; `activate` pins it and places it, and the push follows the commit. Whatever
        fails, the spool is removed; a refusal records nothing but its audit row."""
        spooled: list[Spool] = []

        async def prepare() -> Incoming:
            incoming = await receive()
            spooled.append(incoming.spool)
            # a tenant's files are written even when the store holds them: neither the answer nor its
            # time says whether another version (another tenant's) has the same bytes
            await blobs.put_missing(self.store, incoming.spool.files.values(), rewrite=actor.tenant is not None)
            return incoming

        async def work(session: AsyncSession, incoming: Incoming
                       ) -> tuple[schemas.AdapterLoaded, list[PushOrder], int | None]:
            files, found, req, activate = incoming.spool, incoming.found, incoming.req, incoming.activate
            adapter = await self._adapter_for_load(session, req, found)
            await base_models.refuse_base_model_names(session, adapter)
            await tenant_rules.claim_new(session, adapter, actor)  # a tenant key's new adapter is its tenant's
            if req.replicas is not None:
                set_replicas(adapter, req.replicas, self.planner.defaults)
            version = await session.scalar(select(AdapterVersion).where(
                AdapterVersion.adapter_id == adapter.id, AdapterVersion.sha256 == found.description.sha256))
            created = version is None
            if version is None:
                last = await session.scalar(
                    select(func.max(AdapterVersion.number)).where(AdapterVersion.adapter_id == adapter.id))
                version = AdapterVersion(
                    **msgspec.structs.asdict(found.description), adapter_id=adapter.id, number=(last or 0) + 1,
                    uri=found.path, created_by=actor.actor)
                session.add(version)
                await session.flush()  # a concurrent twin fails here on the unique (adapter, sha256)
            await blobs.reference(session, self.store, version.id, files.files.values())
            orders: list[PushOrder] = []
            warning, previous = None, adapter.active_version_id
            if activate:
                adapter.active_version_id = version.id
                desired = DesiredState.PINNED if req.pinned else DesiredState.LOADED
                orders = await self.planner.place(session, adapter, version, desired, req.engines)
                if not orders and req.engines is None:
                    warning = await self._unplaced_warning(session, adapter.base_model)
            return schemas.AdapterLoaded(
                **msgspec.structs.asdict(version.as_description()), name=adapter.name, version=version.number,
                created=created, engines=[], warning=warning,
                active_version=version.number if activate else None), orders, previous if activate and previous != version.id else None

        try:
            loaded, orders, previous = await self.mutation.run(actor, action, name, work, prepare)
        except Exception:
            for s in spooled:  # its files may be in the store by now: those no version lists go again
                await removal.discard_spooled(self.session, self.mutation.gate, self.store, s.files.values())
            raise
        finally:
            for s in spooled:
                s.close()
        loaded.engines = await self.pusher.push(orders)
        if previous is not None and refused_everywhere(orders, loaded.engines):
            kept = await self._keep_previous(name, loaded.version, previous, actor)
            if kept is not None:
                loaded.active_version, loaded.warning = kept, _kept_warning(loaded.version, kept)
        return loaded

    async def _keep_previous(self, name: str, refused: int, previous_id: int, actor: Principal) -> int | None:
        """Version `refused` was made active and no engine could load it: make the version that was
        active before it (`previous_id`) the active one again, on the engines that hold the adapter
        (audited as keep_active_version). Its number; None when another call changed the active version
        meanwhile, or the previous one is gone."""
        async def work(session: AsyncSession, _: Any) -> tuple[int, list[PushOrder]] | None:
            adapter = await queries.require_adapter(session, name, for_update=True)
            active = await session.get(AdapterVersion, adapter.active_version_id) if adapter.active_version_id else None
            kept = await session.get(AdapterVersion, previous_id)
            if active is None or active.number != refused or kept is None or kept.adapter_id != adapter.id:
                return None
            adapter.active_version_id = kept.id
            return kept.number, await self.planner.switch(session, adapter, kept)

        done = await self.mutation.run(actor, "keep_active_version", name, work,
                                       changed=lambda result: result is not None)
        if done is None:
            return None
        number, orders = done
        await self.pusher.push(orders)
        return number

    async def _unplaced_warning(self, session: AsyncSession, base_model: str) -> str | None:
        """In words, why a load reached no engine, when the reason is that none can take it yet."""
        registered, healthy = await self.planner.coverage(session, base_model)
        if registered == 0:
            return (f"no engine serves base model {base_model!r} yet; the adapter is recorded and will "
                    "be placed when an engine serving that base model registers (engines match by served model "
                    "name, the checkpoint's _name_or_path, its model path or config digest; give base_model to "
                    "name it explicitly)")
        if healthy == 0:
            return (f"no engine serving base model {base_model!r} is healthy right now ({registered} "
                    "registered); the adapter will be placed when one is")
        return None

    async def update(self, name: str, req: schemas.AdapterUpdate, actor: Principal) -> schemas.AdapterUpdated:
        """PATCH /v1/lora_adapters/{name}: new replica counts (replicas added or let go at once), the pin
        (every holder told at once) and/or a new base model (base_models.retarget: released where it no
        longer fits, placed where it does; an admin token only), in one transaction. Audited as
        retarget_lora_adapter (detail: the old and new base model) when `base_model` is given, as
        pin/unpin_lora_adapter when only `pinned` is, else as update_lora_adapter."""
        if req.replicas is None and req.pinned is None and req.base_model is None:
            raise InvalidRequestError("give replicas, pinned, base_model or several of them", param="replicas")

        async def work(session: AsyncSession, _: Any) -> base_models.Retarget:
            if req.base_model is not None and actor.tenant is not None:
                raise PermissionDeniedError("re-targeting an adapter to another base model moves it between "
                                            "engines: it needs an admin token, not a tenant key", param="base_model")
            adapter = await queries.require_adapter(session, name, for_update=True)
            if req.replicas is not None:  # first: a re-target places by the new counts
                set_replicas(adapter, req.replicas, self.planner.defaults)
            done = base_models.Retarget(old=adapter.base_model, new=adapter.base_model)
            if req.base_model is not None:
                done = await base_models.retarget(session, self.planner, adapter, req.base_model)
            if req.replicas is not None and not done.changed:  # a re-target placed by the new counts already
                done.orders += await self.planner.resize(session, adapter)
            if req.pinned is not None:  # after the placing: the replicas it added are pinned too
                done.orders += await pinning.set_pinned(session, self.planner, adapter, req.pinned)
            done.orders = pinning.last_per_engine(done.orders)
            return done

        action, detail = "update_lora_adapter", None
        if req.base_model is not None:
            action, detail = "retarget_lora_adapter", _retarget_detail
        elif req.replicas is None:
            action = "pin_lora_adapter" if req.pinned else "unpin_lora_adapter"
        done = await self.mutation.run(actor, action, name, work, detail=detail)
        engines = await self.pusher.push(done.orders)
        if done.released:
            await transact(self.session, self.mutation.gate,
                           lambda session: base_models.forget_released(session, done.released),
                           what=f"removing the released placements of {name!r}", idempotent=True)
        detail_now = await self.get(name)
        warning = None
        if done.changed and not any(o.action == "load" for o in done.orders):
            warning = await read(self.session, lambda: self._unplaced_warning(self.session, detail_now.base_model),
                                 f"engines of {detail_now.base_model!r}")
        return schemas.AdapterUpdated(**{f: getattr(detail_now, f) for f in detail_now.__struct_fields__},
                                      engines=engines, warning=warning)

    async def _adapter_for_load(self, session: AsyncSession, req: schemas.AdapterCreate,
                                found: InspectedAdapter) -> Adapter:
        # FOR UPDATE (PostgreSQL) orders concurrent loads of one name, so version numbers do not collide.
        adapter = await session.scalar(select(Adapter).where(Adapter.name == req.lora_name).with_for_update())
        if adapter is None:
            _refuse_route_names(req.lora_name)
            base_model = req.base_model or found.base_model_hint
            if not base_model:
                raise InvalidRequestError("base_model is required: adapter_config.json names no "
                                          "base_model_name_or_path", param="base_model")
            adapter = Adapter(name=req.lora_name, base_model=base_model, description=req.description or "",
                              labels=req.labels or {})
            session.add(adapter)
            await session.flush()  # a concurrent first load of the same name fails here on the unique name
            return adapter
        if req.base_model is not None and req.base_model != adapter.base_model:
            raise ConflictError(
                f"adapter {adapter.name!r} is registered for base model {adapter.base_model!r}, not "
                f"{req.base_model!r}; to move it to {req.base_model!r}, re-target it (an admin token: "
                f"loraplane adapters update {shlex.quote(adapter.name)} --base-model {shlex.quote(req.base_model)}, "
                f"or PATCH /v1/lora_adapters/{adapter.name} {{\"base_model\": {json.dumps(req.base_model)}}}) "
                "and send the files again; or send them under another name", param="base_model")
        if req.description is not None:
            adapter.description = req.description
        if req.labels is not None:
            adapter.labels = dict(req.labels)
        return adapter

    async def unload(self, req: schemas.AdapterUnload, actor: Principal) -> schemas.AdapterUnloaded:
        async def work(session: AsyncSession, _: Any) -> list[PushOrder]:
            adapter = await queries.require_adapter(session, req.lora_name)
            return await self.planner.withdraw(session, adapter)

        orders = await self.mutation.run(actor, "unload_lora_adapter", req.lora_name, work)
        return schemas.AdapterUnloaded(name=req.lora_name, engines=await self.pusher.push(orders))

    async def activate(self, name: str, req: schemas.AdapterActivate, actor: Principal) -> schemas.AdapterActivated:
        """Make version `req.version` the active one; when every engine holding the adapter refuses it,
        the version active before stays so (the answer's `warning` says so)."""
        async def work(session: AsyncSession, _: Any) -> tuple[list[PushOrder], int | None]:
            adapter = await queries.require_adapter(session, name, for_update=True)
            version = await session.scalar(select(AdapterVersion).where(
                AdapterVersion.adapter_id == adapter.id, AdapterVersion.number == req.version))
            if version is None:
                raise NotFoundError(f"adapter {name!r} has no version {req.version}", param="version")
            previous = adapter.active_version_id
            adapter.active_version_id = version.id
            return await self.planner.switch(session, adapter, version), previous if previous != version.id else None

        orders, previous = await self.mutation.run(actor, "activate_lora_adapter", f"{name}@{req.version}", work)
        engines = await self.pusher.push(orders)
        warning = None
        if previous is not None and refused_everywhere(orders, engines):
            kept = await self._keep_previous(name, req.version, previous, actor)
            warning = None if kept is None else _kept_warning(req.version, kept)
        detail = await self.get(name)
        return schemas.AdapterActivated(**{f: getattr(detail, f) for f in detail.__struct_fields__}, engines=engines,
                                        warning=warning)

    async def delete(self, name: str, actor: Principal) -> schemas.AdapterDeleted:
        """Remove an adapter and all its versions (409 while an engine should hold it), then its blobs."""
        async def work(session: AsyncSession, _: Any) -> list[int]:
            return await removal.remove_adapter(session, await queries.require_adapter(session, name, for_update=True))

        blob_ids = await self.mutation.run(actor, "delete_lora_adapter", name, work)
        await removal.collect_blobs(self.session, self.mutation.gate, self.store, blob_ids)
        return schemas.AdapterDeleted(name=name)

    async def delete_version(self, name: str, number: int, actor: Principal) -> schemas.VersionDeleted:
        """Remove one version that is neither active nor placed (409 otherwise), then the blobs no other
        version lists."""
        async def work(session: AsyncSession, _: Any) -> list[int]:
            adapter = await queries.require_adapter(session, name, for_update=True)
            return await removal.remove_version(session, adapter, number)

        blob_ids = await self.mutation.run(actor, "delete_lora_adapter_version", f"{name}@{number}", work)
        await removal.collect_blobs(self.session, self.mutation.gate, self.store, blob_ids)
        return schemas.VersionDeleted(name=name, version=number)

    # Reads are retried on a fresh connection when the database connection broke under them (db.transaction.read).
    async def list(self, query: queries.AdapterQuery) -> schemas.AdapterPage:
        return await read(self.session, lambda: queries.list_adapters(self.session, query), "list adapters")

    async def get(self, name: str) -> schemas.AdapterDetail:
        return await read(self.session, lambda: queries.adapter_detail(self.session, name, self.planner),
                          f"get adapter {name!r}")

    async def resolve(self, name: str, base_model: str | None, engine: str | None,
                      actor: Principal) -> schemas.AdapterResolved:
        """The active version to load for `name`. When an engine asks for itself (`engine`, with its engine
        token or an admin token), it is recorded as placed there, so later unloads and activations reach
        it too; like a heartbeat this is the engine's own bookkeeping, not an audited admin call."""
        async def lookup(session: AsyncSession) -> tuple[Adapter, AdapterVersion, bool]:
            adapter, version = await queries.active_version(session, name, base_model)
            return adapter, version, bool(await session.scalar(select(in_store(version.id))))

        if engine is None or actor.kind not in ("admin", "engine"):
            adapter, version, stored = await read(self.session, lambda: lookup(self.session), f"resolve {name!r}")
        else:
            async def adopt(session: AsyncSession) -> tuple[Adapter, AdapterVersion, bool]:
                found = await lookup(session)
                await self.planner.adopt(session, found[0], found[1], engine)
                return found

            # idempotent (the placement exists afterwards either way): retried even if the COMMIT was cut off
            adapter, version, stored = await transact(self.session, self.mutation.gate, adopt,
                                                      what=f"resolve {name!r} for engine {engine!r}", idempotent=True)
        artifact = self.pusher.loader.artifact_ref(version.sha256) if stored else None
        return schemas.AdapterResolved(name=adapter.name, version=version.number, uri=version.uri,
                                       sha256=version.sha256, artifact=artifact)


def _retarget_detail(done: base_models.Retarget) -> dict[str, Any]:
    """A re-target's audit detail: the base model before and after."""
    return {"from": done.old, "to": done.new}


def set_replicas(adapter: Adapter, spec: schemas.ReplicasSpec, defaults: ReplicaDefaults) -> None:
    """Record `replicas {min, max}` (null fields: the defaults; "all" is stored as 0); 400 when min is
    above max. A target demand scaling chose is kept inside the new bounds."""
    high = 0 if spec.max == "all" else spec.max
    rule = ReplicaRule.of(spec.min, high, None, defaults)
    if rule.max and rule.min > rule.max:
        raise InvalidRequestError(f"replicas.min {rule.min} is above replicas.max {rule.max}"
                                  + (" (the default, --default-max-replicas)" if high is None else ""),
                                  param="replicas")
    adapter.min_replicas, adapter.max_replicas = spec.min, high
    target = adapter.target_replicas
    if target is not None and target <= rule.min:
        adapter.target_replicas = None
    elif target is not None and rule.max and target > rule.max:
        adapter.target_replicas = rule.max


def _source_of(lora_path: str, found: InspectedAdapter) -> str:
    """What a version's `uri` records: where its files came from (for people; engines never read it)."""
    if is_object_store_url(lora_path):
        return lora_path.split("?", 1)[0][:1024]
    return found.path


ROUTE_SEGMENTS = ("activate", "versions")  # …/{name}/activate, …/{name}/versions[/{n}]


def _refuse_route_names(name: str) -> None:
    """A name with a segment `activate` or `versions` would read as one of those routes."""
    if any(segment in ROUTE_SEGMENTS for segment in name.split("/")):
        raise InvalidRequestError(f"an adapter name may not have a path segment {' or '.join(ROUTE_SEGMENTS)} "
                                  "(it would read as the route of that name)", param="lora_name")


def upload_request(name: str, fields: dict[str, str]) -> tuple[schemas.AdapterCreate, bool]:
    """An upload's text fields as the load request they amount to, and whether to activate."""
    def flag(key: str, default: bool) -> bool:
        raw = fields.get(key, "").strip().lower()
        if not raw:
            return default
        if raw not in ("true", "false", "1", "0", "yes", "no"):
            raise InvalidRequestError(f"{key} must be true or false, not {raw[:16]!r}", param=key)
        return raw in ("true", "1", "yes")

    problem = name_problem(name)
    if problem is not None:
        raise InvalidRequestError(f"invalid adapter name {name[:64]!r}: {problem}", param="lora_name")
    try:  # ValidationError is a DecodeError too: the JSON text alone is decoded here, nothing else
        replicas = msgspec.json.decode(fields["replicas"]) if fields.get("replicas", "").strip() else None
    except msgspec.DecodeError:
        raise InvalidRequestError('replicas must be a JSON object such as {"min": 1, "max": 2}',
                                  param="replicas") from None
    try:
        req = msgspec.convert({"lora_name": name, "lora_path": "upload", "pinned": flag("pinned", False),
                               "base_model": fields.get("base_model") or None,
                               "description": fields.get("description"), "replicas": replicas}, schemas.AdapterCreate)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"invalid upload field: {exc}", param=_field_of(exc)) from None
    return req, flag("activate", True)


def _field_of(exc: msgspec.ValidationError) -> str | None:
    """The request field a validation error names (msgspec says `at `$.replicas.min``)."""
    found = re.search(r"at `\$\.(\w+)", str(exc))
    return None if found is None else found.group(1)


def refused_everywhere(orders: list[PushOrder], outcomes: list[EngineOutcome]) -> bool:
    """Loads were sent, and not one engine loaded the version."""
    loads = [outcome for order, outcome in zip(orders, outcomes, strict=True) if order.action == "load"]
    return bool(loads) and all(outcome.outcome == "failed" for outcome in loads)


def _kept_warning(refused: int, kept: int) -> str:
    return (f"no engine could load version {refused} (see engines[].error), so version {kept} stays active; "
            f"fix the files and send them again, or activate version {refused} when the engines can load it")
