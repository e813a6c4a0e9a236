"""Rows the placement tests seed straight into the database (no API call)."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.db.models import Adapter, AdapterVersion


async def two_versions(session: AsyncSession, adapters: list[Adapter]) -> list[AdapterVersion]:
    """Versions 1 and 2 of each adapter (rank 8, no files), flushed."""
    versions = [AdapterVersion(adapter_id=a.id, number=n, uri=f"/x/{a.name}/{n}", sha256=f"{a.id:032x}{n:032x}",
                               rank=8, alpha=16.0, target_modules=[], size_bytes=1)
                for a in adapters for n in (1, 2)]
    session.add_all(versions)
    await session.flush()
    return versions
