"""The routing table built from registry rows (SQLite and PostgreSQL): which engines are listed, which
placements make holders and with what residency, which adapters are listed at all, the context length
of each route (its base model's engines' smallest); the fingerprint
under which the encoded table is kept, and the ETag it carries."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator

import msgspec
import pytest
from sqlalchemy import delete, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from control_plane.db import migrate
from control_plane.db.models import Adapter, AdapterVersion, Engine, Placement
from control_plane.domain.routes.cache import EncodedTable, fingerprint
from control_plane.domain.routes.table import build_routes, healthy_engines, route_engines
from shared.routes import Holder, ModelRoute, RoutesTable

STALE_AFTER_S = 30.0


def engine(name: str, base: str = "demo", state: str = "healthy", beat_age_s: float = 0.0, **kw: object) -> Engine:
    beat = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=beat_age_s)
    return Engine(name=name, url="http://127.0.0.1:9", base_model=base, state=state, last_heartbeat=beat, **kw)


@pytest.fixture
async def session(db_url: str) -> AsyncIterator[AsyncSession]:
    db = create_async_engine(db_url)
    await migrate.upgrade(db)
    async with async_sessionmaker(db, expire_on_commit=False)() as s:
        yield s
    await db.dispose()


async def adapter(s: AsyncSession, name: str, base: str, versions: int = 1, active: int | None = 1,
                  scale_state: dict | None = None) -> list[int]:
    row = Adapter(name=name, base_model=base, scale_state=scale_state)
    s.add(row)
    await s.flush()
    ids = []
    for n in range(1, versions + 1):
        v = AdapterVersion(adapter_id=row.id, number=n, uri="x", sha256=f"{n:064x}", rank=4, alpha=8.0,
                           target_modules=["q_proj"], size_bytes=1)
        s.add(v)
        await s.flush()
        ids.append(v.id)
    row.active_version_id = None if active is None else ids[active - 1]
    await s.flush()
    return ids


async def test_the_table_lists_healthy_engines_and_the_holders_of_active_versions(session: AsyncSession) -> None:
    s = session
    engines = {e.name: e for e in (
        # the demo engines disagree on their context length: the smaller one is the routes'; e6 did not say
        engine("e1", max_model_len=2048), engine("e2", model_path="/m/demo", max_model_len=1024),
        engine("sick", state="unhealthy", max_model_len=512),
        engine("leaving", state="draining"), engine("silent", beat_age_s=2 * STALE_AFTER_S), engine("e6", base="other"))}
    s.add_all(engines.values())
    await s.flush()
    ids = {n: e.id for n, e in engines.items()}

    def placed(version: int, on: str, desired: str, observed: str, residency: str | None = None) -> Placement:
        return Placement(engine_id=ids[on], adapter_version_id=version, desired=desired, observed=observed,
                         residency=residency)

    v1, v2 = await adapter(s, "a-loaded", "demo", versions=2, active=2)
    s.add_all([placed(v2, "e1", "loaded", "loaded"),  # residency not reported yet: device
               placed(v2, "e2", "pinned", "loaded", "host"),
               placed(v1, "e6", "loaded", "loaded"),  # not the active version
               placed(v2, "sick", "loaded", "loaded"), placed(v2, "silent", "loaded", "loaded"),
               placed(v2, "leaving", "loaded", "loaded")])  # engines out of the table hold nothing
    (b,) = await adapter(s, "b-mixed", "demo")
    s.add_all([placed(b, "e1", "loaded", "loading"), placed(b, "e2", "pinned", "failed"),
               placed(b, "e6", "absent", "loaded")])  # failed and undesired: no holders
    await adapter(s, "c-never-placed", "/m/demo/")  # matches e2's model path: served as demo
    (d,) = await adapter(s, "d-unloaded", "demo", scale_state={"unloaded": True})  # as an unload leaves it
    s.add(placed(d, "e1", "absent", "absent"))
    (h,) = await adapter(s, "h-all-replaced", "demo")  # none held, not unloaded: placed again, so listed
    s.add(placed(h, "e1", "absent", "absent"))
    await adapter(s, "e-inactive", "demo", active=None)
    (f,) = await adapter(s, "f-absent-observed", "demo")
    s.add(placed(f, "e2", "loaded", "absent"))  # desired, not there yet: on its way
    await adapter(s, "g-unserved", "mistral")
    await s.commit()

    healthy = await healthy_engines(s, STALE_AFTER_S)
    assert [e.name for e in route_engines(healthy)] == ["e1", "e2", "e6"]
    routes = await build_routes(s, healthy)
    assert routes == [
        ModelRoute(model="demo", kind="base", base_model="demo", max_model_len=1024,
                   holders=[Holder(engine="e1", residency="device"), Holder(engine="e2", residency="device")]),
        ModelRoute(model="other", kind="base", base_model="other", holders=[Holder(engine="e6", residency="device")]),
        ModelRoute(model="a-loaded", kind="adapter", base_model="demo", max_model_len=1024,
                   holders=[Holder(engine="e1", residency="device"), Holder(engine="e2", residency="host")]),
        ModelRoute(model="b-mixed", kind="adapter", base_model="demo", max_model_len=1024,
                   holders=[Holder(engine="e1", residency="loading")]),
        ModelRoute(model="c-never-placed", kind="adapter", base_model="demo", max_model_len=1024, holders=[]),
        ModelRoute(model="f-absent-observed", kind="adapter", base_model="demo", max_model_len=1024,
                   holders=[Holder(engine="e2", residency="loading")]),
        ModelRoute(model="g-unserved", kind="adapter", base_model="mistral", holders=[]),
        ModelRoute(model="h-all-replaced", kind="adapter", base_model="demo", max_model_len=1024, holders=[]),
    ]
    # the routes of some adapters only (a demand answer): no base routes
    assert [(r.model, r.max_model_len) for r in await build_routes(s, healthy, ["b-mixed", "d-unloaded", "nope"])
            ] == [("b-mixed", 1024)]
    assert await build_routes(s, [], ["a-loaded"]) == [
        ModelRoute(model="a-loaded", kind="adapter", base_model="demo", holders=[])]


async def test_the_fingerprint_follows_every_row_the_table_depends_on(session: AsyncSession) -> None:
    s = session
    e1, e2 = engine("e1"), engine("e2")
    s.add_all([e1, e2])
    await s.flush()
    v1, v2 = await adapter(s, "a", "demo", versions=2)
    p = Placement(engine_id=e1.id, adapter_version_id=v1, desired="loaded", observed="loading")
    s.add(p)
    await s.commit()
    engines = await healthy_engines(s, STALE_AFTER_S)
    seen = [await fingerprint(s, engines)]
    assert await fingerprint(s, engines) == seen[0]  # nothing changed: the same

    async def changes(stmt: object, engines: list[Engine] = engines) -> None:
        if stmt is not None:
            await s.execute(stmt)
            await s.commit()
        now = await fingerprint(s, engines)
        assert now not in seen, stmt
        seen.append(now)

    await changes(update(Placement).values(observed="loaded"))
    await changes(update(Placement).values(residency="host"))
    await changes(update(Placement).values(desired="pinned"))
    await changes(update(Adapter).values(active_version_id=v2))
    await changes(update(Engine).where(Engine.name == "e2").values(url="http://127.0.0.1:10"),
                  await healthy_engines(s, STALE_AFTER_S))
    await changes(update(Engine).where(Engine.name == "e2").values(max_model_len=512),
                  await healthy_engines(s, STALE_AFTER_S))
    await changes(None, engines[:1])  # an engine left the healthy set
    await changes(delete(Placement))


def test_an_encoded_table_carries_its_etag_and_answers_if_none_match() -> None:
    table = EncodedTable.of(lambda etag: RoutesTable(etag=etag, engines=[], models=[]))
    assert msgspec.json.decode(table.body, type=RoutesTable).etag == table.etag
    again = EncodedTable.of(lambda etag: RoutesTable(etag=etag, engines=[], models=[]))
    assert again == table  # equal tables, equal bytes and ETags
    other = EncodedTable.of(lambda etag: RoutesTable(etag=etag, engines=[], models=[
        ModelRoute(model="m", kind="base", base_model="m", holders=[])]))
    assert other.etag != table.etag
    for header in (table.etag, f"W/{table.etag}", f'"x", {table.etag}', "*"):
        assert table.matches(header), header
    for header in (None, "", '"x"', table.etag.strip('"'), other.etag):
        assert not table.matches(header), header
