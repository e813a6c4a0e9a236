"""Read side of the registry: paged listing with filters, one adapter with its versions and placements."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import msgspec
from sqlalchemy import Select, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.db.models import HOLDING, Adapter, AdapterVersion, DesiredState, Engine, Placement, Tenant
from control_plane.domain.adapters import schemas
from control_plane.domain.engines.health import healthy_clause
from control_plane.domain.engines.matching import serves_base_model
from control_plane.domain.placements.planner import PlacementPlanner
from control_plane.domain.placements.replicas import ReplicaDefaults, ReplicaRule
from control_plane.domain.placements.view import unloaded
from shared.errors import InvalidRequestError, NotFoundError

_Select = TypeVar("_Select", bound=Select[Any])

MAX_PAGE = 500
NO_OWNER = "-"  # the owner filter's value for adapters no tenant owns (no tenant name starts with `-`)
Visibility = Literal["any", "public", "private"]


@dataclass(frozen=True)
class AdapterQuery:
    limit: int = 100
    offset: int = 0
    base_model: str | None = None
    name_prefix: str | None = None
    labels: list[str] = field(default_factory=list)  # "key=value" (equal) or "key" (present)
    owner: str | None = None  # a tenant's name, or NO_OWNER
    visibility: Visibility = "any"

    def __post_init__(self) -> None:
        if not 1 <= self.limit <= MAX_PAGE:
            raise InvalidRequestError(f"limit must be in 1..{MAX_PAGE}", param="limit")
        if self.offset < 0:
            raise InvalidRequestError("offset must be ≥ 0", param="offset")


async def require_adapter(session: AsyncSession, name: str, *, for_update: bool = False) -> Adapter:
    stmt = select(Adapter).where(Adapter.name == name)
    adapter = await session.scalar(stmt.with_for_update() if for_update else stmt)
    if adapter is None:
        raise NotFoundError(f"no adapter named {name!r} is registered", param="name")
    return adapter


def _filtered(stmt: _Select, query: AdapterQuery) -> _Select:
    if query.base_model is not None:
        stmt = stmt.where(Adapter.base_model == query.base_model)
    if query.name_prefix:
        stmt = stmt.where(Adapter.name.startswith(query.name_prefix, autoescape=True))
    if query.owner == NO_OWNER:
        stmt = stmt.where(Adapter.owner_tenant_id.is_(None))
    elif query.owner is not None:
        stmt = stmt.where(Adapter.owner_tenant_id.in_(select(Tenant.id).where(Tenant.name == query.owner)))
    if query.visibility != "any":
        stmt = stmt.where(Adapter.public.is_(query.visibility == "public"))
    for label in query.labels:
        key, has_value, value = label.partition("=")
        # labels[key] renders as JSON_EXTRACT on SQLite and ->> on PostgreSQL
        stmt = stmt.where(Adapter.labels[key].as_string() == value if has_value
                          else Adapter.labels[key].as_string().is_not(None))
    return stmt


async def list_adapters(session: AsyncSession, query: AdapterQuery) -> schemas.AdapterPage:
    total = await session.scalar(_filtered(select(func.count()).select_from(Adapter), query))
    stmt = (_filtered(select(Adapter, AdapterVersion.number, Tenant.name), query)
            .outerjoin(AdapterVersion, AdapterVersion.id == Adapter.active_version_id)
            .outerjoin(Tenant, Tenant.id == Adapter.owner_tenant_id)
            .order_by(Adapter.name).limit(query.limit).offset(query.offset))
    rows = (await session.execute(stmt)).all()
    return schemas.AdapterPage(data=[_adapter(a, n, owner) for a, n, owner in rows], total=total or 0,
                               limit=query.limit, offset=query.offset)


async def adapter_detail(session: AsyncSession, name: str, planner: PlacementPlanner) -> schemas.AdapterDetail:
    adapter = await require_adapter(session, name)
    versions = (await session.scalars(select(AdapterVersion).where(AdapterVersion.adapter_id == adapter.id)
                                      .order_by(AdapterVersion.number))).all()
    placements = (await session.execute(
        select(Placement, Engine.name, AdapterVersion.number, healthy_clause(planner.stale_after_s))
        .join(Engine, Engine.id == Placement.engine_id)
        .join(AdapterVersion, AdapterVersion.id == Placement.adapter_version_id)
        .where(AdapterVersion.adapter_id == adapter.id).order_by(Engine.name, AdapterVersion.number)
    )).all()
    active = next((v.number for v in versions if v.id == adapter.active_version_id), None)
    owner = None if adapter.owner_tenant_id is None else await session.scalar(
        select(Tenant.name).where(Tenant.id == adapter.owner_tenant_id))
    return schemas.AdapterDetail(
        **msgspec.structs.asdict(_adapter(adapter, active, owner)),
        pinned=any(p.desired == DesiredState.PINNED.value for p, *_ in placements),
        versions=[schemas.AdapterVersion(**msgspec.structs.asdict(v.as_description()), number=v.number, uri=v.uri,
                                         created_at=v.created_at, created_by=v.created_by)
                  for v in versions],
        placements=[schemas.Placement(engine=engine, version=number, desired=p.desired, observed=p.observed,
                                      last_error=p.last_error, residency=p.residency, updated_at=p.updated_at)
                    for p, engine, number, _ in placements],
        replicas=_replicas(adapter, planner.defaults,
                           len({e for p, e, _, healthy in placements if healthy and p.desired in HOLDING})),
        last_decision=_decision((adapter.scale_state or {}).get("last_decision")),
    )


def _replicas(adapter: Adapter, defaults: ReplicaDefaults, current: int) -> schemas.Replicas:
    rule = ReplicaRule.of(adapter.min_replicas, adapter.max_replicas, adapter.target_replicas, defaults)
    return schemas.Replicas(min=rule.min, max=rule.max or "all", target=rule.wanted(), current=current)


def _decision(raw: dict[str, Any] | None) -> schemas.ScaleDecision | None:
    if not raw:
        return None
    return schemas.ScaleDecision(at=dt.datetime.fromtimestamp(raw["at"], dt.UTC), from_=raw["from"], to=raw["to"],
                                 reason=raw["reason"], figures=raw.get("figures", {}))


def _adapter(adapter: Adapter, active: int | None, owner: str | None) -> schemas.Adapter:
    """What schemas.Adapter and schemas.AdapterDetail (its subclass) both show of an adapter (`owner`:
    its owner tenant's name)."""
    return schemas.Adapter(name=adapter.name, base_model=adapter.base_model, description=adapter.description,
                           labels=dict(adapter.labels or {}), active_version=active, owner=owner,
                           public=bool(adapter.public), created_at=adapter.created_at, updated_at=adapter.updated_at)


async def active_version(session: AsyncSession, name: str, base_model: str | None) -> tuple[Adapter, AdapterVersion]:
    """The adapter `name` (for `base_model`, when given: its own base model, or an engine's served name when
    that engine serves its base model by any name it registered) and its active version; NotFoundError
    otherwise, and also for an adapter that was unloaded: engines must not pull it back."""
    stmt = (select(Adapter, AdapterVersion).join(AdapterVersion, AdapterVersion.id == Adapter.active_version_id)
            .where(Adapter.name == name))
    row = (await session.execute(stmt)).first()
    if row is None or (base_model is not None and not await _serves(session, row[0], base_model)):
        raise NotFoundError(f"no active adapter named {name!r}" + (f" for base model {base_model!r}" if base_model
                                                                   else ""), param="name")
    adapter, version = row
    if unloaded(adapter):
        raise NotFoundError(f"adapter {name!r} was unloaded; load it again to serve it", param="name")
    return adapter, version


async def _serves(session: AsyncSession, adapter: Adapter, served: str) -> bool:
    if adapter.base_model == served:
        return True
    return await session.scalar(select(Engine.id).where(Engine.base_model == served,
                                                        serves_base_model(adapter.base_model)).limit(1)) is not None
