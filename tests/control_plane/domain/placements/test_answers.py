"""Recording engines' answers on placement rows (answers.record_answers), on SQLite and PostgreSQL: every
kind of answer lands on its rows, a load's replaced versions on that engine are observed absent, and a
round's answers cost a fixed number of statements however many placements the engine has (one UPDATE per
row was most of a reconcile pass at fleet scale: bench/fleet_scale.py). And the fleet pass's reads and
locks by adapter id take more ids than a statement may carry parameters (asyncpg: 32,767)."""

from __future__ import annotations

import datetime as dt

from litestar.testing import AsyncTestClient
from sqlalchemy import event, select
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from control_plane.db.models import Adapter, AdapterVersion, DesiredState, Engine, ObservedState, Placement
from control_plane.domain.placements import view
from control_plane.domain.placements.answers import EngineAnswer, record_answers
from control_plane.domain.placements.planner import lock_placements
from tests.control_plane.domain.placements.rows import two_versions

ADAPTERS = 60


async def _rows(session, engines: int = 2) -> tuple[list[Engine], list[Adapter], dict[tuple[int, int], Placement]]:  # noqa: ANN001
    """`engines` engines and ADAPTERS adapters of two versions each; on every engine v2 desired loaded
    (observed loading) and v1 desired absent (observed loaded: the version being replaced)."""
    now = dt.datetime.now(dt.UTC)
    es = [Engine(name=f"e{i}", url=f"http://127.0.0.1:{9000 + i}", base_model="demo", state="healthy",
                 last_heartbeat=now) for i in range(engines)]
    adapters = [Adapter(name=f"a{k:03d}", base_model="demo", description="", labels={}) for k in range(ADAPTERS)]
    session.add_all(es + adapters)
    await session.flush()
    versions = await two_versions(session, adapters)
    rows = {}
    for e in es:
        for v in versions:
            old = v.number == 1
            rows[e.id, v.id] = Placement(engine_id=e.id, adapter_version_id=v.id,
                                         desired=DesiredState.ABSENT.value if old else DesiredState.LOADED.value,
                                         observed=ObservedState.LOADED.value if old else ObservedState.LOADING.value,
                                         residency="host" if old else None)
    session.add_all(rows.values())
    await session.commit()
    return es, adapters, rows


async def test_a_rounds_answers_land_on_their_rows_in_a_fixed_number_of_statements(client: AsyncTestClient,
                                                                                   settings) -> None:  # noqa: ANN001
    db = create_async_engine(settings.database_url)
    statements: list[str] = []
    try:
        async with async_sessionmaker(db, expire_on_commit=False)() as session:
            (e0, e1), adapters, rows = await _rows(session)
            versions = {(v.adapter_id, v.number): v.id for v in (await session.scalars(select(AdapterVersion))).all()}

            def row(engine: Engine, k: int, number: int) -> Placement:
                return rows[engine.id, versions[adapters[k].id, number]]

            # on e0: the first half loaded (on device or host), a few failed, the rest not answered
            answers = [EngineAnswer(e0.id, (row(e0, k, 2).id,), ObservedState.LOADED,
                                    replaced_adapter_id=adapters[k].id, residency=("device", "host")[k % 2])
                       for k in range(ADAPTERS // 2)]
            answers += [EngineAnswer(e0.id, (row(e0, k, 2).id,), ObservedState.FAILED, error="no room")
                        for k in range(ADAPTERS // 2, ADAPTERS // 2 + 5)]
            def count(_conn, _cursor, sql: str, *_) -> None:  # noqa: ANN001
                statements.append(sql)

            event.listen(db.sync_engine, "before_cursor_execute", count)
            await record_answers(session, answers)
            event.remove(db.sync_engine, "before_cursor_execute", count)
            await session.commit()
        async with async_sessionmaker(db)() as session:
            got = {(p.engine_id, p.adapter_version_id): p for p in (await session.scalars(select(Placement))).all()}
    finally:
        await db.dispose()
    writes = [s for s in statements if s.lstrip().upper().startswith("UPDATE")]
    # loaded on device, loaded on host, failed: three; the replaced versions on e0: one
    assert len(writes) == 4, writes
    for k in range(ADAPTERS):
        new, old = (got[e0.id, versions[adapters[k].id, n]] for n in (2, 1))
        if k < ADAPTERS // 2:
            assert (new.observed, new.residency, new.last_error) == ("loaded", ("device", "host")[k % 2], None)
            assert (old.observed, old.residency) == ("absent", None)  # replaced by the load
        elif k < ADAPTERS // 2 + 5:
            assert (new.observed, new.last_error) == ("failed", "no room")
            assert old.observed == "loaded"  # a failed load replaced nothing
        else:
            assert (new.observed, old.observed) == ("loading", "loaded")  # not answered: untouched
        for n in (1, 2):  # the other engine's rows: untouched
            other = got[e1.id, versions[adapters[k].id, n]]
            assert other.observed == ("loaded" if n == 1 else "loading")


async def test_reads_and_locks_by_adapter_take_more_ids_than_a_statement_takes_parameters(
        client: AsyncTestClient, settings) -> None:  # noqa: ANN001
    db = create_async_engine(settings.database_url)
    try:
        async with async_sessionmaker(db, expire_on_commit=False)() as session:
            _, adapters, rows = await _rows(session, engines=1)
            many = [a.id for a in adapters] + list(range(10**6, 10**6 + 40_000))  # 40,060 ids
            held = await view.holders(session, many)
            await lock_placements(session, view.of_adapters(many))
            await session.execute(select(Adapter.id).where(view.among(Adapter.id, many)).with_for_update())
            await session.commit()
    finally:
        await db.dispose()
    loaded = {p.id for p in rows.values() if p.desired == "loaded"}
    assert {h.placement_id for hs in held.values() for h in hs} == loaded
    assert set(held) == {a.id for a in adapters}
