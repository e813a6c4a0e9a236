"""EngineService: registration (idempotent by name), heartbeats, draining, listing and removal of engines.

Registration, draining and removal are audited mutations (control_plane.uow.Mutation); removal's `forget`
is also what the collector of silent engines runs (domain/engines/collector.py). Heartbeats arrive every
few seconds from every engine, so they are a plain update under the write gate, not an audit row each.
An engine token acts only for its own name (`require_engine`); engine URLs (`url`, and `inference_url` where
an agent's engine serves inference elsewhere) are checked before anything is recorded
(shared.engine_urls). Nothing here depends on an engine's `kind`: it is recorded and shown.

A heartbeat says how the engine is: `healthy` false (its step loop died) makes it unhealthy at once,
`draining` (it is shutting down) makes it draining; either way it gets no new placements and the
reconciler leaves it alone. Draining lasts until the engine registers again (a restart).

The reconciler (domain/placements) sits above the engines registry, so the service reaches it only
through `ReconcilerHooks`, which control_plane.app wires to it.
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.auth import Principal, require_engine
from control_plane.db.models import Adapter, Engine, EngineState, Placement
from control_plane.db.session import WriteGate
from control_plane.db.transaction import read, transact
from control_plane.domain.engines import schemas
from control_plane.domain.engines.health import effective_state, now
from control_plane.settings import ControlPlaneSettings
from control_plane.uow import Mutation
from shared.engine_urls import check_engine_url
from shared.errors import InvalidRequestError, NotFoundError
from shared.sanitize import safe_url, sanitize

logger = logging.getLogger(__name__)


class EngineRoundReport(Protocol):
    """What one engine's reconcile did (domain/placements/reconcile.py's EngineRound)."""

    engine: str
    loaded: list[str]
    unloaded: list[str]
    failed: list[str]
    skipped: bool


@dataclass(frozen=True)
class ReconcilerHooks:
    """The reconciler as the engines registry calls it (wired in control_plane.app)."""

    kick: Callable[[str], None]  # this engine (re-)registered: reconcile it soon
    reconcile_all: Callable[[], Awaitable[Sequence[EngineRoundReport]]]  # every healthy engine, now


class EngineService:
    def __init__(self, session: AsyncSession, settings: ControlPlaneSettings, mutation: Mutation,
                 gate: WriteGate, reconciler: ReconcilerHooks) -> None:
        self.session = session
        self.reconciler = reconciler
        self.settings = settings
        self.mutation = mutation
        self.gate = gate

    async def register(self, req: schemas.EngineCreate, actor: Principal) -> schemas.Engine:
        async def check() -> tuple[str, str | None]:  # inside the mutation: a refusal is audited
            require_engine(actor, req.name)
            allowed = self.settings.engine_allowed_networks
            url = await check_engine_url(req.url, allowed)
            if req.inference_url is None:
                return url, None
            return url, await check_engine_url(req.inference_url, allowed, "inference_url")

        async def work(session: AsyncSession, urls: tuple[str, str | None]) -> Engine:
            await _refuse_adapter_names(session, req.base_model)
            engine = await session.scalar(select(Engine).where(Engine.name == req.name).with_for_update())
            if engine is None:
                engine = Engine(name=req.name)
                session.add(engine)
            engine.url, engine.inference_url = urls
            engine.kind = req.kind
            engine.base_model = req.base_model
            engine.slots_total = req.slots_total
            # what it serves and can hold (an older engine sends none of these: they are cleared)
            engine.model_name_or_path = req.model_name_or_path
            engine.model_path = req.model_path
            engine.config_digest = req.config_digest
            engine.device_kind = req.device_kind
            engine.max_lora_rank = req.max_lora_rank or 0
            engine.max_cpu_loras = req.max_cpu_loras or 0
            engine.max_model_len = req.max_model_len
            engine.credentialed = actor.kind == "engine"  # an admin-registered URL gets no engine key
            engine.state = EngineState.HEALTHY.value
            engine.last_heartbeat = now()
            await session.flush()  # a concurrent first registration of the name fails here; Mutation retries
            return engine

        engine = await self.mutation.run(actor, "register_engine", req.name, work, check)
        self.reconciler.kick(engine.name)  # a re-registration may be a restart that lost its adapters
        return self._engine(engine)

    async def heartbeat(self, name: str, req: schemas.EngineHeartbeat, actor: Principal) -> schemas.Engine:
        require_engine(actor, name)

        async def beat(session: AsyncSession) -> Engine:
            engine = await self._require(name, session)
            engine.last_heartbeat = now()
            before = engine.state
            if req.draining or before == EngineState.DRAINING.value:
                engine.state = EngineState.DRAINING.value  # draining stays draining until it registers
            elif not req.healthy:
                engine.state = EngineState.UNHEALTHY.value
            else:
                engine.state = EngineState.HEALTHY.value
            if engine.state != before:
                logger.warning("engine %s is now %s%s", name, engine.state,
                               f": {sanitize(req.reason)}" if req.reason else "")
            if req.slots_used is not None:
                engine.slots_used = req.slots_used
            if req.slots_total is not None:
                engine.slots_total = req.slots_total
            if req.cache_bytes_free is not None:
                engine.cache_bytes_free = req.cache_bytes_free
            return engine

        # idempotent (the latest state and time), so retried even when the connection broke in the COMMIT
        engine = await transact(self.session, self.gate, beat, what=f"heartbeat of engine {name!r}", idempotent=True)
        return self._engine(engine)

    async def drain(self, name: str, actor: Principal) -> schemas.Engine:
        """The engine is going away: no new placements for it from now on (until it registers again)."""
        async def work(session: AsyncSession, _: Any) -> Engine:
            require_engine(actor, name)  # in the mutation: a refusal is audited
            engine = await self._require(name, session)
            engine.state = EngineState.DRAINING.value
            return engine

        return self._engine(await self.mutation.run(actor, "drain_engine", name, work))

    async def reconcile(self, actor: Principal) -> schemas.ReconcileReport:
        rounds = await self.reconciler.reconcile_all()
        return schemas.ReconcileReport(engines=[schemas.EngineReconciled(
            engine=r.engine, loaded=r.loaded, unloaded=r.unloaded, failed=r.failed, skipped=r.skipped) for r in rounds])

    async def list(self) -> schemas.EngineList:
        engines = await read(self.session, self._all, "list engines")
        return schemas.EngineList(data=[self._engine(e) for e in engines])

    async def delete(self, name: str, actor: Principal) -> schemas.EngineDeleted:
        async def work(session: AsyncSession, _: Any) -> schemas.EngineDeleted:
            # The engine row first (FOR UPDATE: after a reconcile of it ends), then its placements: the
            # reconciler takes them in that order too, so the two cannot deadlock.
            await forget(session, await self._require(name, session, for_update=True))
            return schemas.EngineDeleted(name=name)

        return await self.mutation.run(actor, "delete_engine", name, work)

    async def _all(self) -> builtins.list[Engine]:  # (`list` here is the method above)
        return list((await self.session.scalars(select(Engine).order_by(Engine.name))).all())

    async def _require(self, name: str, session: AsyncSession | None = None, *, for_update: bool = False) -> Engine:
        stmt = select(Engine).where(Engine.name == name)
        engine = await (session or self.session).scalar(stmt.with_for_update() if for_update else stmt)
        if engine is None:
            raise NotFoundError(f"no engine named {name!r} is registered", param="name")
        return engine

    def _engine(self, e: Engine) -> schemas.Engine:
        return schemas.Engine(name=e.name, kind=e.kind, url=safe_url(e.url),
                              inference_url=e.inference_url and safe_url(e.inference_url), base_model=e.base_model,
                              state=effective_state(e, self.settings.engine_stale_after_s),
                              last_heartbeat=e.last_heartbeat, slots_total=e.slots_total, slots_used=e.slots_used,
                              model_name_or_path=e.model_name_or_path, model_path=e.model_path,
                              config_digest=e.config_digest, device_kind=e.device_kind, max_lora_rank=e.max_lora_rank,
                              max_cpu_loras=e.max_cpu_loras, cache_bytes_free=e.cache_bytes_free,
                              max_model_len=e.max_model_len,
                              created_at=e.created_at, updated_at=e.updated_at)


async def forget(session: AsyncSession, engine: Engine) -> None:
    """Delete `engine` (locked FOR UPDATE by the caller) and its placements, in the caller's transaction:
    what `engines remove` and the collector of silent engines both do."""
    # Explicit, as for adapters: SQLite enforces ON DELETE CASCADE only where the pragma is on.
    await session.execute(delete(Placement).where(Placement.engine_id == engine.id))
    await session.execute(delete(Engine).where(Engine.id == engine.id))


async def _refuse_adapter_names(session: AsyncSession, base_model: str) -> None:
    """The mirror of the adapters' rule (domain/adapters/service.py): a base model may not be named like a
    registered adapter. The engine would answer that `model` with its base model, so requests meant for
    the adapter would silently get the base, and the adapter could never be placed there."""
    if await session.scalar(select(Adapter.name).where(Adapter.name == base_model).limit(1)) is not None:
        raise InvalidRequestError(f"base_model {base_model!r} is the name of a registered adapter; requests for "
                                  "that model name would be ambiguous, so serve the base under another name",
                                  param="base_model")
