"""TenantService: the tenants' rules. Every change goes through control_plane.uow.Mutation (one
transaction with its audit row); audit targets name tenants and key ids, never a secret.

- a key's secret is made and hashed (HMAC under the pepper: no pepper, no key, 503) and leaves only in
  the creation's answer; a revocation is published to the routers after the commit;
- a router's `rehash_key` (a key it verified against a legacy argon2 hash) is checked again here before
  the hash is rewritten (TenantAuth.rehash);
- `admin:<tenant>` scopes may name only the key's own tenant;
- `sources` (where the tenant's admin keys may load from) are stored as compared (sources.normalise);
- moving an adapter to a tenant (and a tenant key's first load of a new adapter, `claim_new`) is
  refused (409) once the tenant owns its `adapters` quota.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.auth import Principal
from control_plane.db.models import Adapter, ApiKey, Tenant
from control_plane.db.transaction import read, transact
from control_plane.domain.tenants import schemas
from control_plane.domain.tenants import sources as tenant_sources
from control_plane.domain.tenants.enforcement import tenancy_warnings
from control_plane.domain.tenants.keys import TenantAuth
from control_plane.domain.tenants.revocations import RevocationPublisher
from control_plane.uow import Mutation
from shared import key_secrets
from shared.errors import ConflictError, InvalidRequestError, NotFoundError
from shared.key_checks import InvalidKeyError
from shared.tenants import (
    ADMIN_SCOPE_PREFIX,
    AccessTable,
    AdapterAccess,
    KeyRecord,
    Limits,
    RehashRequest,
    split_key,
)

_LAST_USED_EVERY = dt.timedelta(seconds=30)  # last_used_at is written at most this often per key


def limits_of(row: Tenant | ApiKey) -> Limits:
    return Limits(requests_per_minute=row.requests_per_minute, tokens_per_minute=row.tokens_per_minute,
                  concurrent_requests=row.concurrent_requests,
                  adapters=row.max_adapters if isinstance(row, Tenant) else None)


def _set_limits(row: Tenant | ApiKey, limits: Limits) -> None:
    row.requests_per_minute = limits.requests_per_minute
    row.tokens_per_minute = limits.tokens_per_minute
    row.concurrent_requests = limits.concurrent_requests
    if isinstance(row, Tenant):
        row.max_adapters = limits.adapters
    elif limits.adapters is not None:
        raise InvalidRequestError("the adapters quota is a tenant's, not a key's", param="limits")


def key_view(key: ApiKey, tenant: str) -> schemas.ApiKey:
    return schemas.ApiKey(key_id=key.key_id, tenant=tenant, name=key.name, scopes=list(key.scopes),
                          limits=limits_of(key), created_at=key.created_at, expires_at=key.expires_at,
                          last_used_at=key.last_used_at, revoked_at=key.revoked_at)


async def require_tenant(session: AsyncSession, name: str) -> Tenant:
    tenant = await session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        raise NotFoundError(f"no tenant named {name!r}", param="tenant")
    return tenant


async def sources_of(session: AsyncSession, name: str) -> list[str]:
    """The tenant's sources (control_plane/domain/tenants/sources.py); none for a tenant that is gone."""
    return list(await session.scalar(select(Tenant.sources).where(Tenant.name == name)) or [])


async def _check_adapter_quota(session: AsyncSession, tenant: Tenant, adapter: Adapter) -> None:
    if tenant.max_adapters is None:
        return
    owned = await session.scalar(select(func.count()).select_from(Adapter).where(
        Adapter.owner_tenant_id == tenant.id, Adapter.id != adapter.id))
    if (owned or 0) >= tenant.max_adapters:
        raise ConflictError(f"tenant {tenant.name!r} owns {owned} adapters, its quota", param="owner")


async def claim_new(session: AsyncSession, adapter: Adapter, actor: Principal) -> None:
    """A tenant key's load of an adapter nobody owns yet (its first): the tenant owns it, private, within
    the tenant's adapters quota. Other callers' loads leave ownership as it is."""
    if actor.tenant is None or adapter.owner_tenant_id is not None:
        return
    tenant = await require_tenant(session, actor.tenant)
    await _check_adapter_quota(session, tenant, adapter)
    adapter.owner_tenant_id, adapter.public = tenant.id, False


def _routed_quotas(limits: Limits | None) -> bool:
    """Whether `limits` sets a quota the routers apply (the adapters quota is this control plane's own)."""
    return limits is not None and any(q is not None for q in (
        limits.requests_per_minute, limits.tokens_per_minute, limits.concurrent_requests))


class TenantService:
    def __init__(self, session: AsyncSession, mutation: Mutation, revocations: RevocationPublisher,
                 auth: TenantAuth) -> None:
        self.session = session
        self.mutation = mutation
        self.revocations = revocations
        self.auth = auth

    async def _warnings(self, needs_routers: bool) -> list[str]:
        """Warnings of a change that only routers enforcing tenant keys apply (none when it needs none)."""
        if not needs_routers:
            return []
        return await read(self.session, lambda: tenancy_warnings(self.session), "tenancy enforcement")

    async def _changed(self, name: str, limits: Limits | None) -> schemas.TenantChanged:
        tenant = await self.get(name)
        return schemas.TenantChanged(**{f: getattr(tenant, f) for f in tenant.__struct_fields__},
                                     warnings=await self._warnings(_routed_quotas(limits)))

    async def create(self, req: schemas.TenantCreate, actor: Principal) -> schemas.TenantChanged:
        sources = tenant_sources.normalise(req.sources)

        async def work(session: AsyncSession, _: Any) -> None:
            if await session.scalar(select(Tenant.id).where(Tenant.name == req.name)) is not None:
                raise ConflictError(f"tenant {req.name!r} exists", param="name")
            tenant = Tenant(name=req.name, display_name=req.display_name, sources=sources)
            _set_limits(tenant, req.limits)
            session.add(tenant)

        await self.mutation.run(actor, "create_tenant", req.name, work)
        return await self._changed(req.name, req.limits)

    async def update(self, name: str, req: schemas.TenantUpdate, actor: Principal) -> schemas.TenantChanged:
        sources = None if req.sources is None else tenant_sources.normalise(req.sources)

        async def work(session: AsyncSession, _: Any) -> None:
            tenant = await require_tenant(session, name)
            if req.display_name is not None:
                tenant.display_name = req.display_name
            if req.limits is not None:
                _set_limits(tenant, req.limits)
            if sources is not None:
                tenant.sources = sources

        await self.mutation.run(actor, "update_tenant", name, work)
        await self.revocations.publish(f"tenant:{name}")  # routers fetch its keys' limits again
        return await self._changed(name, req.limits)

    async def list(self) -> schemas.TenantPage:
        async def query() -> list[schemas.Tenant]:
            names = (await self.session.scalars(select(Tenant.name).order_by(Tenant.name))).all()
            return [await self._view(n) for n in names]

        return schemas.TenantPage(data=await read(self.session, query, "list tenants"))

    async def get(self, name: str) -> schemas.Tenant:
        return await read(self.session, lambda: self._view(name), f"get tenant {name!r}")

    async def _view(self, name: str) -> schemas.Tenant:
        tenant = await require_tenant(self.session, name)
        adapters = await self.session.scalar(select(func.count()).select_from(Adapter).where(
            Adapter.owner_tenant_id == tenant.id))
        keys = await self.session.scalar(select(func.count()).select_from(ApiKey).where(
            ApiKey.tenant_id == tenant.id, ApiKey.revoked_at.is_(None)))
        return schemas.Tenant(name=tenant.name, display_name=tenant.display_name, limits=limits_of(tenant),
                              sources=list(tenant.sources), adapters=adapters or 0, keys=keys or 0, created_at=tenant.created_at,
                              updated_at=tenant.updated_at)

    async def create_key(self, tenant_name: str, req: schemas.ApiKeyCreate, actor: Principal) -> schemas.ApiKeyCreated:
        await read(self.session, lambda: require_tenant(self.session, tenant_name), f"tenant {tenant_name!r}")  # 404 first
        for scope in req.scopes:
            if scope.startswith(ADMIN_SCOPE_PREFIX) and scope != ADMIN_SCOPE_PREFIX + tenant_name:
                raise InvalidRequestError(f"a key of tenant {tenant_name!r} may hold admin:{tenant_name} only",
                                          param="scopes")
        if req.expires_at is not None and req.expires_at.tzinfo is None:
            raise InvalidRequestError("expires_at needs a UTC offset", param="expires_at")
        if req.expires_at is not None and req.expires_at <= dt.datetime.now(dt.UTC):
            raise InvalidRequestError("expires_at is in the past", param="expires_at")
        key_id, key, secret_hash = key_secrets.new_key(self.auth.hasher)

        async def work(session: AsyncSession, _: Any) -> schemas.ApiKey:
            tenant = await require_tenant(session, tenant_name)
            row = ApiKey(key_id=key_id, tenant_id=tenant.id, name=req.name, secret_hash=secret_hash,
                         scopes=sorted(set(req.scopes)), expires_at=req.expires_at,
                         created_at=dt.datetime.now(dt.UTC))
            _set_limits(row, req.limits)
            session.add(row)
            await session.flush()
            return key_view(row, tenant.name)

        created = await self.mutation.run(actor, "create_api_key", f"{tenant_name}/{key_id}", work)
        return schemas.ApiKeyCreated(key=key, api_key=created, warnings=await self._warnings(_routed_quotas(req.limits)))

    async def list_keys(self, tenant_name: str) -> schemas.ApiKeyPage:
        async def query() -> list[schemas.ApiKey]:
            tenant = await require_tenant(self.session, tenant_name)
            rows = (await self.session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant.id)
                                               .order_by(ApiKey.created_at, ApiKey.id))).all()
            return [key_view(r, tenant.name) for r in rows]

        return schemas.ApiKeyPage(data=await read(self.session, query, f"list keys of {tenant_name!r}"))

    async def revoke_key(self, tenant_name: str, key_id: str, actor: Principal) -> schemas.ApiKey:
        async def work(session: AsyncSession, _: Any) -> schemas.ApiKey:
            tenant = await require_tenant(session, tenant_name)
            row = await session.scalar(select(ApiKey).where(ApiKey.key_id == key_id, ApiKey.tenant_id == tenant.id))
            if row is None:
                raise NotFoundError(f"tenant {tenant_name!r} has no key {key_id!r}", param="key_id")
            if row.revoked_at is None:
                row.revoked_at = dt.datetime.now(dt.UTC)
            return key_view(row, tenant.name)

        revoked = await self.mutation.run(actor, "revoke_api_key", f"{tenant_name}/{key_id}", work)
        await self.revocations.publish(f"key:{key_id}")
        return revoked

    async def set_access(self, name: str, req: schemas.AdapterAccessUpdate,
                         actor: Principal) -> schemas.AdapterAccessChanged:
        async def work(session: AsyncSession, _: Any) -> AdapterAccess:
            adapter = await session.scalar(select(Adapter).where(Adapter.name == name).with_for_update())
            if adapter is None:
                raise NotFoundError(f"no adapter named {name!r} is registered", param="name")
            owner = None
            if req.owner is not None:
                owner = await require_tenant(session, req.owner)
                if adapter.owner_tenant_id != owner.id:
                    await _check_adapter_quota(session, owner, adapter)
            adapter.owner_tenant_id, adapter.public = (owner.id if owner else None), req.public
            return AdapterAccess(name=adapter.name, owner=req.owner, public=req.public)

        access = await self.mutation.run(actor, "set_adapter_access", name, work)
        private = access.owner is not None and not access.public  # only routers enforcing keys keep it so
        return schemas.AdapterAccessChanged(name=access.name, owner=access.owner, public=access.public,
                                            warnings=await self._warnings(private))

    async def tenant_adapters(self, tenant_name: str) -> AccessTable:
        async def query() -> AccessTable:
            tenant = await require_tenant(self.session, tenant_name)
            rows = (await self.session.execute(select(Adapter.name, Adapter.public).where(
                Adapter.owner_tenant_id == tenant.id).order_by(Adapter.name))).all()
            return AccessTable(adapters=[AdapterAccess(name=n, owner=tenant.name, public=p) for n, p in rows])

        return await read(self.session, query, f"adapters of {tenant_name!r}")

    # the router's reads (router token)
    async def access_table(self) -> AccessTable:
        async def query() -> AccessTable:
            rows = (await self.session.execute(
                select(Adapter.name, Tenant.name, Adapter.public).outerjoin(Tenant, Tenant.id == Adapter.owner_tenant_id)
                .order_by(Adapter.name))).all()
            return AccessTable(adapters=[AdapterAccess(name=n, owner=o, public=p) for n, o, p in rows])

        return await read(self.session, query, "adapter access table")

    async def key_record(self, key_id: str) -> KeyRecord:
        """A key's record for the router (its hash, never a secret); notes when it was last checked."""
        async def lookup(session: AsyncSession) -> KeyRecord:
            found = (await session.execute(select(ApiKey, Tenant).join(Tenant, Tenant.id == ApiKey.tenant_id)
                                           .where(ApiKey.key_id == key_id))).first()
            if found is None:
                raise NotFoundError(f"no key {key_id!r}", param="key_id")
            key, tenant = found
            now = dt.datetime.now(dt.UTC)
            if key.last_used_at is None or now - key.last_used_at > _LAST_USED_EVERY:
                key.last_used_at = now
            return record_of(key, tenant)

        # bookkeeping like a heartbeat, not an audited change; idempotent, so retried even past a cut COMMIT
        return await transact(self.session, self.mutation.gate, lookup, what=f"key record {key_id!r}", idempotent=True)

    async def rehash_key(self, key_id: str, req: RehashRequest, client: str) -> KeyRecord:
        """The key's record once `req.key` is checked against its stored hash, a legacy hash rewritten as
        HMAC; 400 when it is another key or not the key's (counted as a failed attempt), 404 no such key."""
        parts = split_key(req.key)
        if parts is None or parts[0] != key_id:
            raise InvalidRequestError(f"`key` is not a key with the id {key_id!r}.", param="key")
        try:
            await self.auth.rehash(key_id, parts[1], client)
        except InvalidKeyError as exc:
            raise InvalidRequestError(exc.message, param="key") from None
        return await self.key_record(key_id)


def record_of(key: ApiKey, tenant: Tenant) -> KeyRecord:
    return KeyRecord(key_id=key.key_id, tenant=tenant.name, secret_hash=key.secret_hash, scopes=list(key.scopes),
                     expires_at=key.expires_at.timestamp() if key.expires_at else None,
                     revoked=key.revoked_at is not None, limits=limits_of(key), tenant_limits=limits_of(tenant))
