"""Which blobs the store must keep: a version references its files' blobs, in the same transaction that
records the version, and a blob goes only when no manifest lists it any more.

The two writers that can meet on one blob are an upload referencing it and a collection removing it.
Both take the blob's row lock first (PostgreSQL row locks; SQLite's write gate serialises every writer):
- `reference` locks (or creates) the row, then makes sure the object is in the store (putting it again
  from the spool if it is not), then adds the manifest rows; all of it commits together;
- `collect` locks rows that look unreferenced, counts their references again under the lock (a
  statement of its own, so it sees an upload that committed meanwhile), deletes the object and then
  the row, and commits.
So an upload either commits its reference before a collection looks (the blob stays), or waits for the
collection to finish and then finds the row and the object gone, and inserts and puts them again
(tests/control_plane/artifacts/test_blob_race.py drives that order on PostgreSQL). A collection that fails after
deleting an object leaves an unreferenced row without object: harmless, the next reference re-puts it.

An object put before its transaction (`put_missing`) has no row until the commit; a process killed in
between leaves it with none for ever. `orphans` walks the store against the rows: an object older than
the grace period that no row names is collected as any blob is (its row made and locked first, so an
upload that names it meanwhile wins).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable

from sqlalchemy import delete, exists, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.artifacts.spool import SpooledFile
from control_plane.artifacts.store import ArtifactStore
from control_plane.db.models import ArtifactBlob, VersionFile

logger = logging.getLogger(__name__)


async def put_missing(store: ArtifactStore, files: Iterable[SpooledFile], *, rewrite: bool = False) -> None:
    """Copy spooled files into the store ahead of the transaction (the slow part, outside the write gate);
    `rewrite`: those it holds already too (the same bytes under the same key), so that the call takes the
    same work whether or not they were there."""
    for f in files:
        if rewrite or not await store.has(f.sha256, f.size):
            await store.put_file(f.sha256, f.path)


async def _locked_blob(session: AsyncSession, sha256: str, size: int) -> ArtifactBlob:
    """The blob's row, created if need be, and locked: no collection can remove it now. A collection that
    held the row's lock when the insert found it (a lock does not make the insert wait) has deleted it by
    the time the lock is granted; the lock then finds no row, and the insert goes again."""
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    while True:
        await session.execute(insert(ArtifactBlob).values(sha256=sha256, size=size)
                              .on_conflict_do_nothing(index_elements=["sha256"]))
        blob = await session.scalar(select(ArtifactBlob).where(ArtifactBlob.sha256 == sha256)
                                    .with_for_update().execution_options(populate_existing=True))
        if blob is not None:
            return blob


async def reference(session: AsyncSession, store: ArtifactStore, version_id: int,
                    files: Iterable[SpooledFile]) -> None:
    """List `files` as version `version_id`'s manifest (inside the caller's transaction). A version that
    already lists its files is left as it is (same digest, same files)."""
    have = set((await session.scalars(select(VersionFile.name)
                                      .where(VersionFile.adapter_version_id == version_id))).all())
    for f in sorted(files, key=lambda f: f.sha256):  # one lock order across writers: collect's too
        blob = await _locked_blob(session, f.sha256, f.size)
        if not await store.has(f.sha256, f.size):  # collected meanwhile (or never put): put it back
            await store.put_file(f.sha256, f.path)
        if f.name not in have:
            session.add(VersionFile(adapter_version_id=version_id, name=f.name, blob_id=blob.id))
    await session.flush()


async def collect(session: AsyncSession, store: ArtifactStore, blob_ids: Iterable[int] | None = None) -> list[str]:
    """Remove the blobs (of `blob_ids`, or all) that no manifest lists; returns their sha256. Inside the
    caller's transaction, which should commit right after."""
    unreferenced = ~exists().where(VersionFile.blob_id == ArtifactBlob.id)
    query = select(ArtifactBlob).where(unreferenced).order_by(ArtifactBlob.sha256).with_for_update()
    if blob_ids is not None:
        query = query.where(ArtifactBlob.id.in_(list(blob_ids)))
    removed = []
    for blob in (await session.scalars(query)).all():
        count = await session.scalar(select(func.count()).select_from(VersionFile)
                                     .where(VersionFile.blob_id == blob.id))
        if count:
            continue  # an upload referenced it while this collection waited for the lock
        await store.delete(blob.sha256)
        await session.execute(delete(ArtifactBlob).where(ArtifactBlob.id == blob.id))
        removed.append(blob.sha256)
    if removed:
        logger.info("artifact store: removed %d blob(s) no version lists", len(removed))
    return removed


async def discard(session: AsyncSession, store: ArtifactStore, files: Iterable[SpooledFile]) -> list[str]:
    """After a recording that failed or was refused: the objects `put_missing` may have put for `files`
    go again unless a manifest lists them (another version, or a concurrent upload of the same content).
    Each blob's row is created if need be and locked first, so this is a collection like any other."""
    ids = [(await _locked_blob(session, f.sha256, f.size)).id for f in sorted(files, key=lambda f: f.sha256)]
    return await collect(session, store, ids)


async def orphans(session: AsyncSession, store: ArtifactStore, grace_s: float) -> list[tuple[str, int]]:
    """(sha256, size) of the store's objects older than `grace_s` that no blob row names."""
    cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=grace_s)
    old = [(sha, size) async for sha, size, modified in store.blobs() if modified < cutoff]
    known: set[str] = set()
    for start in range(0, len(old), 500):
        names = [sha for sha, _ in old[start:start + 500]]
        known |= set((await session.scalars(select(ArtifactBlob.sha256).where(ArtifactBlob.sha256.in_(names)))).all())
    await session.commit()  # end the read
    return [(sha, size) for sha, size in old if sha not in known]


async def collect_orphan(session: AsyncSession, store: ArtifactStore, sha256: str, size: int) -> list[str]:
    """Collect one object that had no row: its row made and locked, then collected unless a manifest now
    lists it. Inside the caller's transaction."""
    blob = await _locked_blob(session, sha256, size)
    return await collect(session, store, [blob.id])
