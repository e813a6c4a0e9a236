"""PostgreSQL: the race control_plane/artifacts/blobs.py's docstring argues about, driven step by step.

A collection has locked the rows of blobs no manifest lists any more (a version was just removed) and is
about to delete them, when an upload of the same content references those blobs: the upload must wait
for the collection, and end with its manifest rows and its objects present, whichever order the two
then finish in. The collection runs in the test's own session (its transaction held open between its
lock and the rest of the real `blobs.collect`); the upload is a real request to the app.
"""

from __future__ import annotations

import asyncio
import dataclasses

import asyncpg
import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from control_plane.artifacts import blobs
from control_plane.artifacts.store import ArtifactStore
from control_plane.db.models import Adapter, ArtifactBlob
from control_plane.domain.adapters import removal
from tests.control_plane.artifacts.helpers import ADAPTERS, blob_rows, files_of, sha, stored_objects, upload
from tests.control_plane.conftest import reader
from tests.control_plane.test_db_connection_loss import _dsn, pg_settings  # noqa: F401 (fixture)

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture
def settings(pg_settings):  # noqa: ANN001, ANN201, F811 (the app of `concurrent_client`)
    return dataclasses.replace(pg_settings, reconcile_interval_s=3600)


async def _lock_waiter(prober: asyncpg.Connection, besides: int) -> int:
    """The pid of the backend (not `besides`) that waits for a row lock in this database."""
    for _ in range(500):
        pid = await prober.fetchval("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                                    "AND wait_event_type = 'Lock' AND pid <> $1 LIMIT 1", besides)
        if pid is not None:
            return pid
        await asyncio.sleep(0.01)
    raise AssertionError("the upload never waited for the collection's row locks")


async def test_an_upload_that_meets_a_collection_keeps_its_blobs(concurrent_client: httpx.AsyncClient, demo: dict,
                                                                settings) -> None:  # noqa: ANN001
    url = settings.database_url
    poet = demo["demo-poet"]
    r = await upload(concurrent_client, "old", poet, activate="false")  # neither active nor placed
    assert r.status_code == 200, r.text
    expected = sorted(sha(d) for d in files_of(poet).values())
    store = ArtifactStore(settings.artifact_store)
    engine = create_async_engine(url)
    prober = await asyncpg.connect(_dsn(url), timeout=5)
    try:
        async with async_sessionmaker(engine, expire_on_commit=False)() as collector:
            adapter = await collector.scalar(select(Adapter).where(Adapter.name == "old"))
            blob_ids = await removal.remove_version(collector, adapter, 1)  # the version's rows go ...
            # ... and the collection takes its first step: the unreferenced blobs' row locks
            locked = (await collector.scalars(select(ArtifactBlob.id).where(ArtifactBlob.id.in_(blob_ids))
                                              .with_for_update())).all()
            assert sorted(locked) == sorted(blob_ids) and len(locked) == 2
            pid = (await (await collector.connection()).get_raw_connection()).dbapi_connection._connection \
                .get_server_pid()
            uploading = asyncio.create_task(upload(concurrent_client, "new", poet))
            await _lock_waiter(prober, pid)  # the upload waits for a blob the collection holds
            assert not uploading.done()
            removed = await blobs.collect(collector, store, blob_ids)  # the rest of the real collection
            await collector.commit()
        assert sorted(removed) == expected  # nobody listed them when it looked: it removed them
        r = await asyncio.wait_for(uploading, 30)
    finally:
        await prober.close()
        await engine.dispose()
    assert r.status_code == 200, r.text
    assert await blob_rows(url) == stored_objects(settings) == expected  # the upload put them back
    got = await concurrent_client.get(f"/v1/artifacts/{r.json()['sha256']}/{WEIGHTS}", headers=reader())
    assert got.status_code == 200 and got.content == files_of(poet)[WEIGHTS]
    assert (await concurrent_client.get(f"{ADAPTERS}/old", headers=reader())).json()["versions"] == []
