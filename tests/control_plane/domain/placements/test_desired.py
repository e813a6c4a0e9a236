"""Desired state written set-based (placements/desired.py), on SQLite and PostgreSQL: a set of pairs lands
on the rows as one pair at a time did (new rows inserted, a released row desired again, the adapter's other
versions on that engine desired absent, nothing else touched) in a fixed number of statements; and a fleet
pass re-placing every adapter of an engine that left, then releasing its placements once the new ones are
loaded, makes one INSERT and a few UPDATEs however many adapters it moves (bench/fleet_pass.py --leave: a
pass after 10 of 200 engines left took 47 s at 100,000 adapters with several statements per placement)."""

from __future__ import annotations

import datetime as dt

from litestar.testing import AsyncTestClient
from sqlalchemy import event, select, update
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from control_plane.db.models import Adapter, DesiredState, Engine, ObservedState, Placement
from control_plane.domain.placements.desired import Held, desire_held
from control_plane.domain.placements.fleet import FleetPass
from tests.control_plane.domain.placements.rows import two_versions

ADAPTERS = 60


class Statements:
    """The SQL statements a block sends (a cursor listener on the engine)."""

    def __init__(self, db) -> None:  # noqa: ANN001
        self.db, self.sql = db, list[str]()

    def _seen(self, _conn, _cursor, sql: str, *_) -> None:  # noqa: ANN001
        self.sql.append(sql.lstrip().upper())

    def __enter__(self) -> Statements:
        event.listen(self.db.sync_engine, "before_cursor_execute", self._seen)
        return self

    def __exit__(self, *_) -> None:  # noqa: ANN002
        event.remove(self.db.sync_engine, "before_cursor_execute", self._seen)

    def count(self, verb: str, table: str = "placements") -> int:
        return sum(s.startswith(verb) and table.upper() in s.split("WHERE")[0] for s in self.sql)


async def _fleet(session, engines: int) -> tuple[list[Engine], list[Adapter], dict[tuple[int, int], int]]:  # noqa: ANN001
    """`engines` healthy engines and ADAPTERS adapters of two versions each, v2 active; answers
    (adapter id, number) -> version id."""
    now = dt.datetime.now(dt.UTC)
    es = [Engine(name=f"e{i}", url=f"http://127.0.0.1:{9000 + i}", base_model="demo", state="healthy",
                 last_heartbeat=now, slots_total=4, max_cpu_loras=200) for i in range(engines)]
    adapters = [Adapter(name=f"a{k:03d}", base_model="demo", description="", labels={}, min_replicas=1,
                        max_replicas=1) for k in range(ADAPTERS)]
    session.add_all(es + adapters)
    await session.flush()
    versions = await two_versions(session, adapters)
    ids = {(v.adapter_id, v.number): v.id for v in versions}
    for a in adapters:
        a.active_version_id = ids[a.id, 2]
    await session.flush()
    return es, adapters, ids


async def _placements(session) -> dict[tuple[int, int], tuple[int, str, str]]:  # noqa: ANN001
    """(engine id, version id) -> (placement id, desired, observed)."""
    rows = (await session.execute(select(Placement.engine_id, Placement.adapter_version_id, Placement.id,
                                         Placement.desired, Placement.observed))).all()
    return {(e, v): (i, d, o) for e, v, i, d, o in rows}


async def test_a_set_of_pairs_lands_as_one_pair_at_a_time_did_in_a_fixed_number_of_statements(
        client: AsyncTestClient, settings) -> None:  # noqa: ANN001
    db = create_async_engine(settings.database_url)
    try:
        async with async_sessionmaker(db, expire_on_commit=False)() as session:
            (e0, e1, e2, e3), adapters, version = await _fleet(session, 4)
            # e0 holds v1 (being replaced), e1 had v2 released, e2 nothing, e3 holds v1 and is left out
            session.add_all([Placement(engine_id=e.id, adapter_version_id=version[a.id, n], desired=d,
                                       observed=ObservedState.LOADED.value)
                             for a in adapters for e, n, d in ((e0, 1, "loaded"), (e1, 2, "absent"), (e3, 1, "loaded"))])
            await session.commit()
            before = await _placements(session)
            pairs = [Held(a.id, version[a.id, 2], e.id, mode) for a in adapters
                     for e, mode in ((e0, DesiredState.LOADED), (e1, DesiredState.PINNED), (e2, DesiredState.LOADED))]
            pairs.append(pairs[0])  # named twice: one row
            with Statements(db) as seen:
                ids = await desire_held(session, pairs)
            await session.commit()
            after = await _placements(session)
    finally:
        await db.dispose()
    assert (seen.count("SELECT"), seen.count("UPDATE"), seen.count("INSERT")) == (1, 2, 1), seen.sql
    assert len(ids) == 3 * ADAPTERS
    for a in adapters:
        v1, v2 = version[a.id, 1], version[a.id, 2]
        assert after[e0.id, v1][1:] == ("absent", "loaded")  # the other version there: desired absent
        assert after[e0.id, v2][1:] == ("loaded", "absent")  # inserted, not observed yet
        assert after[e1.id, v2] == (before[e1.id, v2][0], "pinned", "loaded")  # the same row, desired again
        assert after[e2.id, v2][1:] == ("loaded", "absent")
        assert after[e3.id, v1] == before[e3.id, v1]  # an engine not named: untouched
        for e in (e0, e1, e2):
            assert ids[e.id, v2] == after[e.id, v2][0]
    assert len(after) == len(before) + 2 * ADAPTERS


async def test_a_pass_after_an_engine_left_replaces_its_adapters_in_a_few_statements(
        client: AsyncTestClient, settings) -> None:  # noqa: ANN001
    db = create_async_engine(settings.database_url)
    fleet = FleetPass(settings)
    try:
        async with async_sessionmaker(db, expire_on_commit=False)() as session:
            es, adapters, version = await _fleet(session, 3)
            session.add_all([Placement(engine_id=es[k % 3].id, adapter_version_id=version[a.id, 2],
                                       observed=ObservedState.LOADED.value) for k, a in enumerate(adapters)])
            await session.commit()
            gone = es[0]
            left = {a.id for k, a in enumerate(adapters) if k % 3 == 0}
            await session.execute(update(Engine).where(Engine.id == gone.id).values(
                last_heartbeat=dt.datetime.now(dt.UTC) - dt.timedelta(days=1)))
            await session.commit()
            with Statements(db) as replacing:
                async with session.begin():
                    replaced = await fleet.run(session)
            after_replace = await _placements(session)
            await session.execute(update(Placement).values(observed=ObservedState.LOADED.value))
            await session.commit()
            with Statements(db) as releasing:
                async with session.begin():
                    released = await fleet.run(session)
            after_release = await _placements(session)
    finally:
        await db.dispose()
    names = {a.id: a.name for a in adapters}
    assert sorted(name for name, _ in replaced.added) == sorted(names[i] for i in left)
    assert {engine for _, engine in replaced.added} <= {"e1", "e2"}
    assert replaced.released == []  # make before break: the new ones are not loaded yet
    assert replacing.count("INSERT") == 1 and replacing.count("UPDATE") == 0, replacing.sql
    for k, a in enumerate(adapters):
        held = {e for (e, v), (_, d, _) in after_replace.items() if v == version[a.id, 2] and d == "loaded"}
        if a.id in left:  # kept on the engine that left until the new one is loaded, and one new one
            assert gone.id in held and len(held - {gone.id}) == 1
        else:
            assert held == {es[k % 3].id}
    assert sorted(released.released) == sorted((names[i], "e0") for i in left)
    assert releasing.count("UPDATE") == 1 and releasing.count("INSERT") == 0, releasing.sql
    for a in adapters:
        held = {e for (e, v), (_, d, _) in after_release.items() if v == version[a.id, 2] and d == "loaded"}
        assert len(held) == 1 and gone.id not in held
