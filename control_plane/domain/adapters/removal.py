"""Removing an adapter or one of its versions from the registry, and then the blobs nobody lists any more.

Both are refused (409) while an engine should still hold what would go: the active version cannot be
removed (activate another first), nor a version or adapter still desired on an engine (unload first).
Rows go in an explicit order instead of relying on ON DELETE CASCADE (SQLite enforces it only per
connection). The removed versions' blobs are collected afterwards, in a transaction of their own
(control_plane/artifacts/blobs.py says why that order keeps a concurrent upload's blobs).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable

from sqlalchemy import ColumnElement, delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.artifacts import blobs
from control_plane.artifacts.spool import SpooledFile
from control_plane.artifacts.store import ArtifactStore
from control_plane.db.models import HOLDING, Adapter, AdapterVersion, Placement, VersionFile
from control_plane.db.session import WriteGate
from control_plane.db.transaction import transact
from control_plane.domain.placements.planner import lock_placements, of_adapter
from shared.errors import ConflictError, NotFoundError

logger = logging.getLogger(__name__)


async def _refuse_if_held(session: AsyncSession, versions: ColumnElement[bool], what: str) -> None:
    held = await session.scalar(select(func.count()).select_from(Placement).where(
        versions, Placement.desired.in_(HOLDING)))
    if held:
        raise ConflictError(f"{what} is still placed on {held} engine(s); unload it first "
                            "(POST /v1/unload_lora_adapter)")


async def _drop_versions(session: AsyncSession, version_ids: list[int]) -> list[int]:
    """Delete the versions' placements, manifests and rows; the blob ids their manifests listed."""
    blob_ids = list((await session.scalars(select(VersionFile.blob_id).where(
        VersionFile.adapter_version_id.in_(version_ids)))).all())
    await session.execute(delete(Placement).where(Placement.adapter_version_id.in_(version_ids)))
    await session.execute(delete(VersionFile).where(VersionFile.adapter_version_id.in_(version_ids)))
    await session.execute(delete(AdapterVersion).where(AdapterVersion.id.in_(version_ids)))
    return blob_ids


async def remove_adapter(session: AsyncSession, adapter: Adapter) -> list[int]:
    await lock_placements(session, of_adapter(adapter.id))  # the one order of placement writers
    version_ids = list((await session.scalars(select(AdapterVersion.id)
                                              .where(AdapterVersion.adapter_id == adapter.id))).all())
    await _refuse_if_held(session, Placement.adapter_version_id.in_(version_ids), f"adapter {adapter.name!r}")
    await session.execute(update(Adapter).where(Adapter.id == adapter.id).values(active_version_id=None))
    blob_ids = await _drop_versions(session, version_ids)
    await session.execute(delete(Adapter).where(Adapter.id == adapter.id))
    return blob_ids


async def remove_version(session: AsyncSession, adapter: Adapter, number: int) -> list[int]:
    version = await session.scalar(select(AdapterVersion).where(
        AdapterVersion.adapter_id == adapter.id, AdapterVersion.number == number))
    if version is None:
        raise NotFoundError(f"adapter {adapter.name!r} has no version {number}", param="version")
    if adapter.active_version_id == version.id:
        raise ConflictError(f"version {number} is the active version of {adapter.name!r}; activate another "
                            f"version first (POST /v1/lora_adapters/{adapter.name}/activate)", param="version")
    await lock_placements(session, of_adapter(adapter.id))
    await _refuse_if_held(session, Placement.adapter_version_id == version.id,
                          f"version {number} of {adapter.name!r}")
    return await _drop_versions(session, [version.id])


async def collect_blobs(session: AsyncSession, gate: WriteGate, store: ArtifactStore, blob_ids: list[int]) -> None:
    """Remove the blobs of `blob_ids` that no manifest lists now. A failure is logged, never raised: the
    removal itself committed, and an unreferenced blob is collected with the next removal that lists it."""
    if blob_ids:
        await _collecting(session, gate, lambda s: blobs.collect(s, store, blob_ids), "of a removed version")


async def discard_spooled(session: AsyncSession, gate: WriteGate, store: ArtifactStore,
                          files: Iterable[SpooledFile]) -> None:
    """After a load or upload that was refused or failed once its files were in the store: the objects no
    manifest lists go again (logged, never raised: the caller is answering with the original error)."""
    files = list(files)
    if files:
        await _collecting(session, gate, lambda s: blobs.discard(s, store, files), "of a refused version")


async def _collecting(session: AsyncSession, gate: WriteGate, work: Callable[[AsyncSession], Awaitable[list[str]]],
                      whose: str) -> None:
    try:
        await transact(session, gate, work, what=f"collecting the unreferenced blobs {whose}", idempotent=True)
    except Exception:
        logger.exception("could not collect the blobs %s; they stay in the store", whose)
