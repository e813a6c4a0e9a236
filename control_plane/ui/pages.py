"""What each console page shows, read through the services the API controllers use (and, for the
fleet's queues, the demand rows the reconciler records per engine)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.db.models import DemandReport, EngineState
from control_plane.domain.adapters import schemas as adapter_schemas
from control_plane.domain.adapters.queries import AdapterQuery
from control_plane.domain.adapters.service import AdapterService
from control_plane.domain.audit import schemas as audit_schemas
from control_plane.domain.audit.service import AuditQuery, AuditService
from control_plane.domain.engines import schemas as engine_schemas
from control_plane.domain.engines.health import STALE
from control_plane.domain.engines.service import EngineService
from control_plane.domain.placements.demand import ENGINE_SOURCE, engine_source
from control_plane.domain.stats import history
from control_plane.domain.stats.history import Series

ADAPTERS_PER_PAGE = 50  # each row reads its adapter's placements too
AUDIT_PER_PAGE = 100


@dataclass(frozen=True)
class EngineRow:
    engine: engine_schemas.Engine
    running: int
    waiting: int

    @property
    def stale(self) -> bool:
        """Its heartbeats stopped: listed apart, removable."""
        return self.engine.state == STALE

    @property
    def removable(self) -> bool:
        """What the Fleet page offers to remove: engines gone silent or shutting down."""
        return self.engine.state in (STALE, EngineState.DRAINING.value)


@dataclass(frozen=True)
class AdapterFilters:
    search: str = ""  # a name prefix
    base_model: str = ""
    label: str = ""  # key=value or key
    owner: str = ""  # a tenant's name, or queries.NO_OWNER

    def query(self, offset: int) -> AdapterQuery:
        return AdapterQuery(limit=ADAPTERS_PER_PAGE, offset=offset, base_model=self.base_model or None,
                            name_prefix=self.search or None, labels=[self.label] if self.label else [],
                            owner=self.owner or None)


async def fleet(engines: EngineService, session: AsyncSession) -> list[EngineRow]:
    """Every engine with its queue: the sums of the running and waiting figures of its last stats
    (the demand rows `engine:<name>` the reconciler replaces each interval)."""
    listed = (await engines.list()).data
    rows = (await session.execute(
        select(DemandReport.source, func.sum(DemandReport.running), func.sum(DemandReport.waiting))
        .where(DemandReport.source.in_([engine_source(e.name) for e in listed])).group_by(DemandReport.source)
    )).all()
    queues = {source.removeprefix(ENGINE_SOURCE): (int(r or 0), int(w or 0)) for source, r, w in rows}
    return [EngineRow(e, *queues.get(e.name, (0, 0))) for e in listed]


async def adapters(service: AdapterService, filters: AdapterFilters, offset: int
                   ) -> tuple[list[adapter_schemas.AdapterDetail], int]:
    """A page of adapters with their placements, and the total the filters match."""
    page = await service.list(filters.query(offset))
    details = [await service.get(a.name) for a in page.data]
    return details, page.total


async def adapter(service: AdapterService, audit: AuditService, session: AsyncSession, name: str,
                  interval_s: float) -> tuple[adapter_schemas.AdapterDetail, list[audit_schemas.AuditEvent], Series]:
    """One adapter, its audit trail (rows on `name` and `name@version`, newest first) and its last hour
    of figures (the charts)."""
    detail = await service.get(name)
    trail = await audit.page(AuditQuery(limit=AUDIT_PER_PAGE, adapter=name))
    return detail, trail.data, await history.series(session, name, interval_s)


def rollback_target(detail: adapter_schemas.AdapterDetail) -> int | None:
    """The newest version older than the active one: what "roll back" activates."""
    older = [v.number for v in detail.versions if detail.active_version is not None and v.number < detail.active_version]
    return max(older) if older else None
