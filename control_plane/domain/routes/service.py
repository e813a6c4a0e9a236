"""RoutesService: the routing table with its ETag, and the routers' demand reports.

The table (table.py: a few set-based queries) is encoded once with msgspec and kept while a cheap
fingerprint of the rows it depends on is unchanged (cache.py). Its ETag is a strong validator, the
quoted sha256 of the encoded table: equal tables, equal ETags, so a router revalidating every second
gets 304 (and no body) until something a router would route by changed. The body's `etag` is the
same quoted value.

A demand report (`POST /v1/routes/demand`):
- `demand`: per-model queue figures, recorded for the adapters among them under the source
  `router:<token id>:<router name>` (control_plane.domain.placements.demand; each report replaces that
  source's rows, so router replicas sharing a token keep their own);
- `router`: the router's presence (control_plane.domain.routers), recorded in the same write;
  an idempotent write, not an audited mutation (routers report every few seconds);
- `place`: adapters the router has requests for and nobody holds. Each registered, servable one is
  placed by the planner (`ensure_placed`) in one audited mutation; after the commit the orders are
  pushed to the engines exactly as after a load (Pusher), so the answer's routes show where the
  adapter is now held. Names that are no servable adapter come back in `unknown` (the router's 404).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.auth import Principal
from control_plane.db.models import Adapter
from control_plane.db.session import WriteGate
from control_plane.db.transaction import read, transact
from control_plane.domain.placements.demand import ROUTER_SOURCE, AdapterDemand, record_demand
from control_plane.domain.placements.planner import PlacementPlanner, PushOrder
from control_plane.domain.placements.push import Pusher
from control_plane.domain.routers.service import record_presence
from control_plane.domain.routes.cache import EncodedTable, RoutesCache, fingerprint
from control_plane.domain.routes.table import build_routes, healthy_engines, route_engines, servable
from control_plane.settings import ControlPlaneSettings
from control_plane.uow import Mutation
from shared.routes import DemandAnswer, DemandReport, ModelDemand, RouterPresence, RoutesTable

_LOOKUP_CHUNK = 1000  # names per IN (…) query: far below SQLite's and asyncpg's bound-parameter limits
_AUDIT_TARGET = 256  # audit_events.target's length


@dataclass
class RoutesService:
    session: AsyncSession
    settings: ControlPlaneSettings
    mutation: Mutation
    gate: WriteGate
    planner: PlacementPlanner
    pusher: Pusher
    cache: RoutesCache

    async def table(self) -> EncodedTable:
        async def current() -> EncodedTable:
            engines = await healthy_engines(self.session, self.settings.engine_stale_after_s)

            async def build() -> EncodedTable:
                models = await build_routes(self.session, engines)
                return EncodedTable.of(lambda etag: RoutesTable(etag=etag, engines=route_engines(engines),
                                                                models=models))

            return await self.cache.get(await fingerprint(self.session, engines), build)

        return await read(self.session, current, "routes table")

    async def report(self, report: DemandReport, actor: Principal) -> DemandAnswer:
        if report.demand or report.router is not None:
            figures = _summed(report.demand)
            source = _source(actor, report.router)

            async def record(session: AsyncSession) -> None:
                if report.router is not None:
                    await record_presence(session, report.router, actor.token_id)
                ids = {a.name: a.id for a in await _adapters(session, list(figures))} if figures else {}
                await record_demand(session, source, (
                    AdapterDemand(adapter_id=ids[name], waiting=w, running=r)
                    for name, (w, r) in figures.items() if name in ids))

            # idempotent (each report replaces the source's rows), so retried even when the COMMIT broke
            await transact(self.session, self.gate, record, what="demand report", idempotent=True)
        if not report.place:
            return DemandAnswer(placed=[], unknown=[])
        names = list(dict.fromkeys(report.place))

        async def place(session: AsyncSession, _: Any) -> tuple[list[PushOrder], list[str]]:
            adapters = {a.name: a for a in await _adapters(session, names, for_update=True)}
            orders = [o for name in names if name in adapters
                      for o in await self.planner.ensure_placed(session, adapters[name])]
            return orders, [name for name in names if name not in adapters]

        orders, unknown = await self.mutation.run(actor, "place_adapters", ", ".join(names)[:_AUDIT_TARGET], place,
                                                  changed=lambda result: bool(result[0]))  # audited when placed
        await self.pusher.push(orders)  # records each engine's answer, as after a load

        async def placed() -> DemandAnswer:
            engines = await healthy_engines(self.session, self.settings.engine_stale_after_s)
            known = [n for n in names if n not in unknown]
            return DemandAnswer(placed=await build_routes(self.session, engines, known) if known else [],
                                unknown=unknown)

        return await read(self.session, placed, "routes of placed adapters")


def _source(actor: Principal, router: RouterPresence | None) -> str:
    """The demand rows' source: per router process (replicas share a token; each must keep its own rows),
    the name hashed when it would not fit demand_reports.source."""
    if router is None:
        return f"{ROUTER_SOURCE}{actor.token_id}"
    name = router.name if len(router.name) <= 100 else hashlib.sha256(router.name.encode()).hexdigest()[:32]
    return f"{ROUTER_SOURCE}{actor.token_id}:{name}"


def _summed(demand: Iterable[ModelDemand]) -> dict[str, tuple[int, int]]:
    """(waiting, running) per model, a model listed twice counted once with both figures added."""
    figures: dict[str, tuple[int, int]] = {}
    for d in demand:
        waiting, running = figures.get(d.model, (0, 0))
        figures[d.model] = (waiting + d.waiting, running + d.running)
    return figures


async def _adapters(session: AsyncSession, names: list[str], *, for_update: bool = False) -> list[Adapter]:
    """The servable adapters (table.servable) among `names`, looked up in chunks."""
    found: list[Adapter] = []
    for start in range(0, len(names), _LOOKUP_CHUNK):
        stmt = select(Adapter).where(Adapter.name.in_(names[start:start + _LOOKUP_CHUNK]), servable())
        found += (await session.scalars(stmt.order_by(Adapter.id).with_for_update() if for_update else stmt)).all()
    return found
