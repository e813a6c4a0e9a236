"""One engine as a reconcile round takes it: its row locked, its placements read, and which of its answers
change anything.

The engine row is locked FOR NO KEY UPDATE for the whole round (see reconcile.py), so that two replicas
never reconcile one engine at once. A round that finds it locked waits for it at most LOCK_WAIT_MS and
then skips the engine: another replica's round holds it for seconds, but a heartbeat of the engine holds
it for the milliseconds of its commit, and SKIP LOCKED would skip every engine whose heartbeat is
committing (docs/performance.md#control-plane). SQLite (one replica) takes no row lock.

A round reads every placement of its engine (hundreds at fleet scale, every interval) as columns, not ORM
objects, which would be most of a steady round's time in the control plane. Its answers are
compared with what the rows say already: an answer that would write nothing (`record_answers` leaves a row
that already says so) is not sent to the database at all, so a steady round over an engine that still
holds what it should writes nothing but its demand. This is decided on the round's own read: a writer in
between (a push recording another answer) keeps its answer until the next round, which reads it and
answers again: the same as if that writer had recorded just after the round.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.db.models import Adapter, AdapterVersion, DesiredState, Engine, ObservedState, Placement
from control_plane.db.session import has_sqlstate
from control_plane.domain.placements.answers import EngineAnswer, values_of
from control_plane.domain.placements.loads import RecordedVersion
from control_plane.domain.placements.planner import in_store


@dataclass(frozen=True, slots=True)
class EngineRow:
    """A placement on the engine, with its adapter's name and the version's recorded bytes."""

    placement_id: int
    desired: str
    observed: str
    last_error: str | None
    residency: str | None
    adapter_id: int
    adapter: str
    version: RecordedVersion

    def says(self, values: dict[str, str | None]) -> bool:
        """The row holds these column values already."""
        return all(getattr(self, column) == value for column, value in values.items())


LOCK_WAIT_MS = 500  # a heartbeat's commit, not another replica's round
LOCK_NOT_AVAILABLE = "55P03"


async def take_engine(session: AsyncSession, name: str, is_sqlite: bool) -> Engine | None:
    """The engine's row, locked until the caller's transaction ends; None when it was deleted or another
    round holds it (the transaction is then rolled back)."""
    stmt = select(Engine).where(Engine.name == name).with_for_update(key_share=True)  # FOR NO KEY UPDATE
    if is_sqlite:
        row = await session.scalar(stmt)  # named first: in `return await …` the checker picks the untyped overload
        return row
    await session.execute(text(f"SET LOCAL lock_timeout = '{LOCK_WAIT_MS}ms'"))
    try:
        engine = await session.scalar(stmt)
    except DBAPIError as exc:
        if not has_sqlstate(exc, LOCK_NOT_AVAILABLE):
            raise
        await session.rollback()
        return None
    await session.execute(text("SET LOCAL lock_timeout TO DEFAULT"))  # the recording waits as any writer does
    return engine


_GONE = {"observed": ObservedState.ABSENT.value, "last_error": None, "residency": None}


async def engine_rows(session: AsyncSession, engine_id: int) -> list[EngineRow]:
    rows = (await session.execute(
        select(Placement.id, Placement.desired, Placement.observed, Placement.last_error, Placement.residency,
               AdapterVersion.adapter_id, Adapter.name, AdapterVersion.sha256, AdapterVersion.uri,
               in_store(AdapterVersion.id), AdapterVersion.size_bytes, AdapterVersion.number)
        .join(AdapterVersion, AdapterVersion.id == Placement.adapter_version_id)
        .join(Adapter, Adapter.id == AdapterVersion.adapter_id)
        .where(Placement.engine_id == engine_id).order_by(Placement.id)
    )).all()
    return [EngineRow(pid, desired, observed, error, residency, adapter_id, name,
                      RecordedVersion(sha256=sha, uri=uri, in_store=bool(stored), size_bytes=size, number=number))
            for pid, desired, observed, error, residency, adapter_id, name, sha, uri, stored, size, number in rows]


def news(answers: Sequence[EngineAnswer], rows: Sequence[EngineRow]) -> list[EngineAnswer]:
    """The answers that change a row: their own rows' columns, or (a successful load) the adapter's other
    versions on the engine not yet observed gone. An answer whose replaced versions are all gone already
    keeps its own columns only."""
    by_id = {r.placement_id: r for r in rows}
    answered = {i for a in answers for i in a.placement_ids}
    lingering = {r.adapter_id for r in rows  # adapters with another version on the engine not observed gone
                 if r.placement_id not in answered and r.desired == DesiredState.ABSENT.value and not r.says(_GONE)}
    out = []
    for answer in answers:
        own = values_of(answer)
        changes = any(i not in by_id or not by_id[i].says(own) for i in answer.placement_ids)
        replaced = answer.replaced_adapter_id if answer.replaced_adapter_id in lingering else None
        if changes or replaced is not None:
            out.append(dataclasses.replace(answer, replaced_adapter_id=replaced))
    return out
