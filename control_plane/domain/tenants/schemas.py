"""Wire schemas of the tenants API (msgspec): tenants, their keys, and who may use an adapter."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

import msgspec

from control_plane.domain.tenants.sources import MAX_SOURCES
from shared.tenants import AdapterAccess, Limits, Scope, TenantName

MAX_SCOPES = 8
KeyName = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern="^[^\\x00]*$")]
DisplayName = Annotated[str, msgspec.Meta(max_length=256, pattern="^[^\\x00]*$")]


Source = Annotated[str, msgspec.Meta(min_length=1, max_length=1024, pattern="^[^\\x00]*$")]
Sources = Annotated[list[Source], msgspec.Meta(
    max_length=MAX_SOURCES, description="where the tenant's admin keys may load from (control_plane/domain/"
    "tenants/sources.py): absolute folders (/path, file:///path; resolved, and under --lora-roots) and URL "
    "prefixes (s3://bucket/prefix, gs://…, az://…, hf://org[/name[@revision]]); empty: uploads only")]


class TenantCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/tenants."""

    name: TenantName
    display_name: DisplayName = ""
    limits: Limits = msgspec.field(default_factory=Limits)
    sources: Sources = msgspec.field(default_factory=list)


class TenantUpdate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """PATCH /v1/tenants/{tenant}: a field left out is kept; `limits` replaces all the quotas, `sources`
    all the sources."""

    display_name: DisplayName | None = None
    limits: Limits | None = None
    sources: Sources | None = None


class Tenant(msgspec.Struct, kw_only=True):
    name: str
    display_name: str
    limits: Limits
    sources: list[str]  # where its admin keys may load from, as compared (empty: uploads only)
    adapters: int  # adapters it owns
    keys: int  # keys not revoked
    created_at: dt.datetime
    updated_at: dt.datetime


Warnings = Annotated[list[str], msgspec.Meta(
    description="what the change does not do yet, and how to make it (no router enforcing tenant keys); "
    "empty when nothing stands in its way")]


class TenantChanged(Tenant, kw_only=True):
    """A tenant as created or updated, with what stands in the way of its quotas."""

    warnings: Warnings = msgspec.field(default_factory=list)


class TenantPage(msgspec.Struct, kw_only=True):
    data: list[Tenant]


class ApiKeyCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/tenants/{tenant}/keys: `admin:<tenant>` may name only the key's own tenant; `limits`
    (requests, tokens, concurrent) apply to this key on top of the tenant's."""

    name: KeyName
    scopes: Annotated[list[Scope], msgspec.Meta(min_length=1, max_length=MAX_SCOPES)] = msgspec.field(
        default_factory=lambda: ["inference"])
    expires_at: dt.datetime | None = None
    limits: Limits = msgspec.field(default_factory=Limits)


class ApiKey(msgspec.Struct, kw_only=True):
    """A key as listed: its id (the public part of the key), never its secret."""

    key_id: str
    tenant: str
    name: str
    scopes: list[str]
    limits: Limits
    created_at: dt.datetime
    expires_at: dt.datetime | None
    last_used_at: dt.datetime | None  # the last time a router or this control plane checked it (within 5 s)
    revoked_at: dt.datetime | None


class ApiKeyCreated(msgspec.Struct, kw_only=True):
    """The answer of a key's creation: `key` is shown here once and never again."""

    key: str
    api_key: ApiKey
    warnings: Warnings = msgspec.field(default_factory=list)


class ApiKeyPage(msgspec.Struct, kw_only=True):
    data: list[ApiKey]


class AdapterAccessUpdate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """PUT /v1/tenancy/adapters/{name}: the adapter's owner tenant (null: nobody's) and whether every
    tenant may use it. Moving an adapter to a tenant counts against that tenant's adapters quota."""

    owner: TenantName | None
    public: bool = False


class AdapterAccessChanged(AdapterAccess, kw_only=True):
    """PUT /v1/tenancy/adapters/{name}'s answer: the adapter's access, with what stands in its way."""

    warnings: Warnings = msgspec.field(default_factory=list)
