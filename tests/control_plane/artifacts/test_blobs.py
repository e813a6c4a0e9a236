"""DELETE …/{name}/versions/{n} and DELETE …/{name}: what may go (neither active nor placed), and which blobs
go with it: exactly those no remaining version lists, from the database and from the store's folder."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from litestar.testing import AsyncTestClient
from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from control_plane.db.models import Adapter, AdapterVersion, DesiredState, Engine, ObservedState, Placement
from control_plane.settings import ControlPlaneSettings
from tests.control_plane.artifacts.helpers import (
    ADAPTERS,
    blob_rows,
    files_of,
    recorded,
    sha,
    stored_objects,
    upload,
)
from tests.control_plane.conftest import admin, reader
from tests.control_plane.domain.adapters.helpers import add_engines, audit

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def variant(demo: dict, tmp_path: Path) -> Path:
    """demo-poet with another config (a description of its own): the same weights blob, another config blob."""
    folder = tmp_path / "variant"
    folder.mkdir()
    files = files_of(demo["demo-poet"])
    config = json.loads(files[CONFIG])
    (folder / CONFIG).write_text(json.dumps({**config, "revision": "variant"}))
    (folder / WEIGHTS).write_bytes(files[WEIGHTS])
    return folder


async def place(url: str, adapter: str, number: int) -> None:
    """A placement that holds `adapter@number` on engine e1, as the planner or an engine's adoption writes."""
    engine = create_async_engine(url)
    try:
        async with async_sessionmaker(engine)() as session:
            version = await session.scalar(select(AdapterVersion).join(Adapter, Adapter.id == AdapterVersion.adapter_id)
                                           .where(Adapter.name == adapter, AdapterVersion.number == number))
            e1 = await session.scalar(select(Engine).where(Engine.name == "e1"))
            session.add(Placement(engine_id=e1.id, adapter_version_id=version.id, desired=DesiredState.LOADED.value,
                                  observed=ObservedState.LOADED.value, updated_at=dt.datetime.now(dt.UTC)))
            await session.commit()
    finally:
        await engine.dispose()


def shas(*folders: Path) -> list[str]:
    return sorted({sha(data) for folder in folders for data in files_of(folder).values()})


async def test_a_version_goes_with_the_blobs_only_it_lists(client: AsyncTestClient, demo: dict, tmp_path: Path,
                                                           settings: ControlPlaneSettings) -> None:
    url = settings.database_url
    poet, short, other = demo["demo-poet"], demo["demo-short"], variant(demo, tmp_path)
    for name, folder, fields in (("a", poet, {}), ("a", other, {}), ("a", short, {}), ("b", poet, {})):
        r = await upload(client, name, folder, **fields)
        assert r.status_code == 200, r.text
    assert await blob_rows(url) == stored_objects(settings) == shas(poet, short, other)

    active = await client.delete(f"{ADAPTERS}/a/versions/3", headers=admin())
    assert active.status_code == 409 and "active version" in active.json()["error"]["message"], active.text
    await add_engines(url, ("e1", "demo", "healthy"))
    await place(url, "a", 2)
    placed = await client.delete(f"{ADAPTERS}/a/versions/2", headers=admin())
    assert placed.status_code == 409 and "placed on 1 engine" in placed.json()["error"]["message"], placed.text
    assert (await client.delete(f"{ADAPTERS}/a/versions/9", headers=admin())).status_code == 404
    assert (await client.delete(f"{ADAPTERS}/a/versions/1", headers=reader())).status_code == 403

    r = await client.delete(f"{ADAPTERS}/a/versions/1", headers=admin())  # poet: b@1 lists the same files
    assert r.status_code == 200 and r.json() == {"name": "a", "version": 1, "deleted": True}, r.text
    assert await blob_rows(url) == stored_objects(settings) == shas(poet, short, other)
    assert [v["number"] for v in (await client.get(f"{ADAPTERS}/a", headers=reader())).json()["versions"]] == [2, 3]

    r = await client.delete(f"{ADAPTERS}/b", headers=admin())  # now nobody lists poet's config; a@2 its weights
    assert r.status_code == 200, r.text
    assert await blob_rows(url) == stored_objects(settings) == shas(short, other)
    assert sha(files_of(poet)[WEIGHTS]) in stored_objects(settings)

    assert (await client.delete(f"{ADAPTERS}/a", headers=admin())).status_code == 409  # a@2 is still placed
    engine = create_async_engine(url)
    try:
        async with async_sessionmaker(engine)() as session:
            for placement in (await session.scalars(select(Placement))).all():
                placement.desired = DesiredState.ABSENT.value  # unloaded
            await session.commit()
    finally:
        await engine.dispose()
    r = await client.delete(f"{ADAPTERS}/a/versions/2", headers=admin())
    assert r.status_code == 200, r.text
    assert await blob_rows(url) == stored_objects(settings) == shas(short)
    assert (await client.delete(f"{ADAPTERS}/a", headers=admin())).status_code == 200  # the adapter collects too
    assert await recorded(url) == (0, 0, 0, 0) and stored_objects(settings) == []
    assert [(a, t, o) for a, t, o in await audit(url) if a.startswith("delete")] == [
        ("delete_lora_adapter_version", "a@3", "409 conflict_error"),
        ("delete_lora_adapter_version", "a@2", "409 conflict_error"),
        ("delete_lora_adapter_version", "a@9", "404 not_found_error"),
        ("delete_lora_adapter", f"{ADAPTERS}/a/versions/1", "403 permission_error"),  # the guard's own row
        ("delete_lora_adapter_version", "a@1", "ok"),
        ("delete_lora_adapter", "b", "ok"),
        ("delete_lora_adapter", "a", "409 conflict_error"),
        ("delete_lora_adapter_version", "a@2", "ok"),
        ("delete_lora_adapter", "a", "ok")]


async def test_a_removed_version_can_be_uploaded_again(client: AsyncTestClient, demo: dict,
                                                       settings: ControlPlaneSettings) -> None:
    for folder in (demo["demo-poet"], demo["demo-short"]):
        assert (await upload(client, "c", folder)).status_code == 200
    assert (await client.delete(f"{ADAPTERS}/c/versions/1", headers=admin())).status_code == 200
    assert stored_objects(settings) == shas(demo["demo-short"])
    r = await upload(client, "c", demo["demo-poet"])
    assert r.status_code == 200 and r.json()["version"] == 3, r.text  # numbers are not reused
    digest = r.json()["sha256"]
    got = await client.get(f"/v1/artifacts/{digest}/{WEIGHTS}", headers=reader())
    assert got.status_code == 200 and got.content == files_of(demo["demo-poet"])[WEIGHTS]
    assert stored_objects(settings) == shas(demo["demo-poet"], demo["demo-short"])
