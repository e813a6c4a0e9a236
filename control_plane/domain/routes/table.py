"""The routing table from the registry: which engines a router may call and who holds each model.

Built with three set-based queries however many adapters there are (100,000 adapters × 200 engines is
the scale the fleet benchmark runs): the healthy engines, the adapters with an active version, and the
placements of those active versions on those engines. Nothing is read per adapter.

- engines: healthy ones only (stored state `healthy` and a fresh heartbeat: domain/engines/health.py;
  draining and unhealthy engines are out), as `RouteEngine`, with whether each registered itself with its
  own engine credential (routers send the engines' inference key only to those) and its inference URL
  when that is not its admin URL (an engine driven by `loraplane agent`: routers send inference there);
- one `base` route per served base model, held on device by each of its engines;
- one `adapter` route per adapter with an active version that was not unloaded (the rule engines'
  resolve follows: placements exist and none is desired held; control_plane.domain.adapters.queries),
  so a router answers 404 for it as the engines do; its holders are the placements of that
  version desired loaded or pinned on a healthy engine: observed `loaded` → the residency the engine
  last reported (`device` when not known yet), `loading`/`absent` → `loading` (placed, on its way),
  `failed`/`draining` → not a holder. An adapter's `base_model` is the served name of the engines that
  hold it (or serve its base model: domain/engines/matching.py), else the name it was registered with.
- every route's `max_model_len`: the smallest context length the healthy engines of its base model
  registered (None when none did), what routers reserve a tenant's tokens by.

Everything is ordered (engines and holders by name, base routes then adapters by name), so equal
registries encode to equal bytes and the ETag (service.py) changes only when the table does.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection

from sqlalchemy import ColumnElement, and_, false, func, not_, select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.db.models import HOLDING, Adapter, Engine, ObservedState, Placement
from control_plane.domain.engines.health import healthy_clause
from control_plane.domain.engines.matching import engine_serves
from control_plane.domain.placements.view import UNLOADED
from shared.routes import Holder, ModelRoute, Residency, RouteEngine
from shared.sanitize import safe_url

# observed state of a placement desired held -> its residency for routing (None: not a holder)
_PLACED: dict[str, Residency] = {ObservedState.LOADING.value: "loading", ObservedState.ABSENT.value: "loading"}
# as engines report it; `loaded` (an engine that cannot say where, vLLM through its agent) ranks as
# `device`: vLLM serves its runtime-loaded adapters from its GPU's LoRA slots
_RESIDENT: dict[str | None, Residency] = {"device": "device", "host": "host", "loaded": "device"}


def servable() -> ColumnElement[bool]:
    """Adapters with an active version that were not unloaded (the flag placements.view.unloaded reads)."""
    unloaded = func.coalesce(Adapter.scale_state[UNLOADED].as_boolean(), false())
    return and_(Adapter.active_version_id.is_not(None), not_(unloaded))


async def healthy_engines(session: AsyncSession, stale_after_s: float) -> list[Engine]:
    stmt = select(Engine).where(healthy_clause(stale_after_s)).order_by(Engine.name)
    return list((await session.scalars(stmt)).all())


async def build_routes(session: AsyncSession, engines: list[Engine],
                       adapter_names: Collection[str] | None = None) -> list[ModelRoute]:
    """Base routes of `engines` (all of them unless `adapter_names` is given), then the adapter routes of
    every adapter with an active version (or only of those named)."""
    by_id = {e.id: e for e in engines}
    contexts = _context_lengths(engines)
    routes: list[ModelRoute] = [] if adapter_names is not None else _base_routes(engines, contexts)
    stmt = (select(Adapter.name, Adapter.base_model, Adapter.active_version_id)
            .where(servable()).order_by(Adapter.name))
    if adapter_names is not None:
        stmt = stmt.where(Adapter.name.in_(list(adapter_names)))
    adapters = (await session.execute(stmt)).all()
    active = {version_id for _, _, version_id in adapters}
    holders = await _holders(session, by_id, active, narrow=adapter_names is not None) if adapters and by_id else {}
    served: dict[str, str] = {}  # an adapter's registered base model -> the served name of its engines
    for name, base_model, version_id in adapters:
        held = holders.get(version_id, [])
        if held:
            base = by_id[held[0][0]].base_model
        else:
            if base_model not in served:
                served[base_model] = next((e.base_model for e in engines if engine_serves(e, base_model)), base_model)
            base = served[base_model]
        routes.append(ModelRoute(model=name, kind="adapter", base_model=base,
                                 holders=[Holder(engine=by_id[e].name, residency=r) for e, r in held],
                                 max_model_len=contexts.get(base)))
    return routes


def route_engines(engines: list[Engine]) -> list[RouteEngine]:
    return [RouteEngine(name=e.name, url=safe_url(e.url), base_model=e.base_model, credentialed=e.credentialed,
                        inference_url=e.inference_url and safe_url(e.inference_url)) for e in engines]


def _context_lengths(engines: list[Engine]) -> dict[str, int]:
    """Served base model -> the smallest context length its engines registered (those that did)."""
    contexts: dict[str, int] = {}
    for e in engines:
        if e.max_model_len:
            contexts[e.base_model] = min(e.max_model_len, contexts.get(e.base_model, e.max_model_len))
    return contexts


def _base_routes(engines: list[Engine], contexts: dict[str, int]) -> list[ModelRoute]:
    by_base: dict[str, list[Engine]] = defaultdict(list)
    for e in engines:
        by_base[e.base_model].append(e)
    return [ModelRoute(model=base, kind="base", base_model=base,
                       holders=[Holder(engine=e.name, residency="device") for e in held],
                       max_model_len=contexts.get(base))
            for base, held in sorted(by_base.items())]


async def _holders(session: AsyncSession, engines: dict[int, Engine], active: set[int], *,
                   narrow: bool) -> dict[int, list[tuple[int, Residency]]]:
    """Active version id -> [(engine id, residency)] ordered by engine name, for placements desired held
    on the given engines and not failed. The versions are filtered here, not joined in SQL (a join on
    adapters.active_version_id, which has no index, is slow on SQLite at fleet scale); only
    a `narrow` call (a few adapters) names them in the query."""
    stmt = (select(Placement.adapter_version_id, Placement.engine_id, Placement.observed, Placement.residency)
            .where(Placement.desired.in_(HOLDING), Placement.engine_id.in_(list(engines))))
    if narrow:
        stmt = stmt.where(Placement.adapter_version_id.in_(list(active)))
    found: dict[int, list[tuple[int, Residency]]] = defaultdict(list)
    for version_id, engine_id, observed, residency in (await session.execute(stmt)).all():
        if version_id not in active:
            continue  # a version that is not its adapter's active one (the switch is under way)
        if observed == ObservedState.LOADED.value:
            found[version_id].append((engine_id, _RESIDENT.get(residency, "device")))
        elif observed in _PLACED:
            found[version_id].append((engine_id, _PLACED[observed]))
    for held in found.values():
        held.sort(key=lambda h: engines[h[0]].name)
    return found
