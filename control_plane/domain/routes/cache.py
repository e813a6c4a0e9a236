"""The encoded routing table, kept while the registry's routing-relevant rows are unchanged.

Building the table at fleet scale is costly (reading every placement row and encoding them all), and
every router revalidates every second; nearly always nothing has changed. So each call first takes a
fingerprint (two aggregate queries over `adapters` and `placements`, far cheaper than a build:
docs/performance.md#control-plane; plus the healthy engines it reads anyway) and rebuilds only when it
differs from the one the cached table was built under, or when the cached table is older than
`max_age_s` (the fingerprint is a hash sum: two changes that cancel out are improbable, not
impossible, and the age bounds how long such a coincidence could last).

The fingerprint is taken before the table is built, so a change racing the build leaves a table
newer than its key: the next call sees another fingerprint and builds again; never an old table
under a new key. One build at a time (an asyncio lock): concurrent callers wait for it and share it.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field

import msgspec
from sqlalchemy import ColumnElement, SQLColumnExpression, case, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.db.models import Adapter, Engine, Placement
from shared.routes import RoutesTable

MAX_AGE_S = 10.0
# hash weights: (id × Knuth's multiplier) mod a prime, so a row's contribution depends on which row it is
_MULTIPLIER, _PRIME = 2654435761, 1000003
_PLACEHOLDER = "\x00etag\x00"  # encodes as "\u0000etag\u0000": no table string can hold it unescaped
_ENCODED_PLACEHOLDER = msgspec.json.encode(_PLACEHOLDER)


@dataclass(frozen=True)
class EncodedTable:
    etag: str  # quoted, as the ETag header carries it
    body: bytes

    @classmethod
    def of(cls, build: Callable[[str], RoutesTable]) -> EncodedTable:
        """Encode `build(etag)` once: the ETag is the quoted sha256 of the encoding with a placeholder in
        `etag` (the first field), which is then replaced by the ETag itself."""
        encoded = msgspec.json.encode(build(_PLACEHOLDER))
        etag = f'"{hashlib.sha256(encoded).hexdigest()}"'
        return cls(etag, encoded.replace(_ENCODED_PLACEHOLDER, msgspec.json.encode(etag), 1))

    def matches(self, if_none_match: str | None) -> bool:
        """Whether an `If-None-Match` header names this table (RFC 9110: weak comparison, `*`, lists)."""
        if not if_none_match:
            return False
        tags = [t.strip().removeprefix("W/") for t in if_none_match.split(",")]
        return "*" in tags or self.etag in tags


def _weight(column: SQLColumnExpression[int]) -> ColumnElement[int]:
    return (column * _MULTIPLIER) % _PRIME


def _code(column: SQLColumnExpression[str | None], values: tuple[str, ...]) -> ColumnElement[int]:
    return case(*((column == v, i + 1) for i, v in enumerate(values)), else_=0)


async def fingerprint(session: AsyncSession, engines: list[Engine]) -> Hashable:
    """What the table depends on: the healthy engines' fields, and hash sums over adapters (which have
    which active version) and placements (desired, observed, residency of each row)."""
    state = (_code(Placement.desired, ("loaded", "pinned", "absent")) * 64
             + _code(Placement.observed, ("loaded", "loading", "absent", "failed", "draining")) * 8
             + _code(Placement.residency, ("device", "host")))
    placements = (await session.execute(select(
        func.count(), func.coalesce(func.sum(_weight(Placement.id) * (state + 1)), 0)))).one()
    adapters = (await session.execute(select(
        func.count(), func.coalesce(func.sum(_weight(Adapter.id) * (func.coalesce(Adapter.active_version_id, 0)
                                                                    % _PRIME + 1)), 0)))).one()
    served = tuple((e.id, e.name, e.url, e.inference_url, e.credentialed, e.base_model, e.model_name_or_path,
                    e.model_path, e.config_digest, e.max_model_len) for e in engines)
    return served, tuple(placements), tuple(adapters)


@dataclass
class RoutesCache:
    max_age_s: float = MAX_AGE_S
    _key: Hashable = None
    _table: EncodedTable | None = None
    _built_at: float = 0.0
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def get(self, key: Hashable, build: Callable[[], Awaitable[EncodedTable]]) -> EncodedTable:
        async with self._lock:
            fresh = time.monotonic() - self._built_at < self.max_age_s
            if self._table is None or key != self._key or not fresh:
                self._table, self._key, self._built_at = await build(), key, time.monotonic()
            return self._table
