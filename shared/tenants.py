"""Tenants' API keys and adapter access, defined once for the control plane and the router (msgspec).

A key reads `lp_<key id>_<secret>`: the key id (12 hex digits) is public and names the row, so a key is
found without scanning; only a keyed hash of it is stored (shared/key_secrets.py). The router fetches a
key's record by its id (`GET /v1/tenancy/keys/{key_id}`, router token), verifies the secret against the
hash once and caches the verified key; a legacy (argon2) hash it verified is rewritten by the control
plane (`POST /v1/tenancy/keys/{key_id}/rehash`, `RehashRequest`). Revocations reach it through Redis
(`revocation_channel`) and the cache's TTL bounds the worst case. `GET /v1/tenancy/adapters` lists who
may use which adapter (owner tenant, public).

Limits are per minute (requests, tokens = prompt + generated), in flight at once (concurrent), and the
number of adapters a tenant owns (enforced by the control plane); None is unlimited.

Torch-free; extend additively (unknown fields are ignored on decode).
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

KEYS_PATH = "/v1/tenancy/keys"
REHASH_SUFFIX = "/rehash"  # KEYS_PATH/{key_id} + this: a legacy hash rewritten as HMAC
ACCESS_PATH = "/v1/tenancy/adapters"
KEY_PREFIX = "lp_"
KEY_ID_HEX = 12
INFERENCE = "inference"
ADMIN_SCOPE_PREFIX = "admin:"
TENANT_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"  # goes into scopes, metrics labels and Redis keys as is
KEY_PATTERN = rf"^{KEY_PREFIX}([0-9a-f]{{{KEY_ID_HEX}}})_([A-Za-z0-9_-]{{20,128}})$"
_KEY = re.compile(KEY_PATTERN)

TenantName = Annotated[str, msgspec.Meta(pattern=TENANT_NAME_PATTERN,
                                         description="1–63 of lower-case letters, digits, `_` and `-`")]
Limit = Annotated[int, msgspec.Meta(ge=1, le=1 << 40)]
Count = Annotated[int, msgspec.Meta(ge=1, le=(1 << 31) - 1)]  # what the database's integer columns hold
Scope = Annotated[str, msgspec.Meta(pattern=r"^(inference|admin:[a-z0-9][a-z0-9_-]{0,62})$",
                                    description="`inference` or `admin:<tenant>` (the key's own tenant)")]


class Limits(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Quotas; a field left out or null is unlimited."""

    requests_per_minute: Limit | None = None
    tokens_per_minute: Limit | None = None  # prompt + generated
    concurrent_requests: Count | None = None
    adapters: Count | None = None  # adapters the tenant owns (a tenant's limit only; the control plane's)


class KeyRecord(msgspec.Struct, kw_only=True):
    """What the router needs of one key: never the secret, its hash only."""

    key_id: str
    tenant: str
    secret_hash: str  # `$hmac-sha256$…`, or a legacy argon2 PHC string (`$argon2…`)
    scopes: list[str]
    expires_at: float | None  # seconds since the epoch
    revoked: bool
    limits: Limits  # the key's own
    tenant_limits: Limits  # the tenant's, shared by all its keys


class RehashRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A key a router verified against its legacy hash, for the control plane to check again and rehash."""

    key: Annotated[str, msgspec.Meta(pattern=KEY_PATTERN, description="the whole key, `lp_<key id>_<secret>`")]


class AdapterAccess(msgspec.Struct, kw_only=True):
    name: str
    owner: str | None  # the owner tenant; None: nobody's
    public: bool  # usable by every tenant


class AccessTable(msgspec.Struct, kw_only=True):
    adapters: list[AdapterAccess]


def split_key(key: str) -> tuple[str, str] | None:
    """(key id, secret) of a well-formed tenant key, None for anything else (e.g. a static key)."""
    match = _KEY.match(key)
    return (match[1], match[2]) if match else None


def revocation_channel(prefix: str) -> str:
    """The Redis channel on which the control plane names revoked keys (`key:<id>`) and tenants whose
    limits changed (`tenant:<name>`)."""
    return f"{prefix}revocations"

