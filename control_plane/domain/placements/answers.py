"""What an engine answered, recorded on placement rows the same way for a push and for a reconcile.

A load that succeeded is observed `loaded`, and the adapter's other versions on that engine, desired absent,
are observed `absent` (loads are sent with `load_inplace`, so the engine replaced them); an unload is
`absent`; a failure is `failed` with the engine's error in `last_error`. Where the engine said where it
keeps a loaded version (device | host: the reconciler reads it from GET /v1/lora_adapters) that is
recorded as `residency`; a row no longer loaded has none. Rows are locked first, in the one
order of placement writers (ascending id, see planner), and a row already saying the same is not rewritten.

A reconcile round answers for every placement of its engine (hundreds at fleet scale, every interval),
so the writes are set-based: one UPDATE per distinct answer (observed, error, residency) over all the
rows answered so, and one per engine for the replaced versions; a row answered for itself keeps its own
answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import ColumnElement, and_, or_, update
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.db.models import DesiredState, ObservedState, Placement
from control_plane.domain.placements.planner import lock_placements
from control_plane.domain.placements.view import of_adapters


@dataclass(frozen=True)
class EngineAnswer:
    """One engine's answer about one adapter, and the placement rows that record it."""

    engine_id: int
    placement_ids: tuple[int, ...]
    observed: ObservedState
    error: str | None = None
    replaced_adapter_id: int | None = None  # a load that succeeded: this adapter's other versions are gone there
    residency: str | None = None  # loaded: where the engine keeps it, when it said


def _replaced(answers: Sequence[EngineAnswer]) -> dict[int, set[int]]:
    """Engine id -> the adapters whose other versions a successful load there replaced."""
    out: dict[int, set[int]] = {}
    for a in answers:
        if a.replaced_adapter_id is not None:
            out.setdefault(a.engine_id, set()).add(a.replaced_adapter_id)
    return out


def _touched(answers: Sequence[EngineAnswer]) -> ColumnElement[bool]:
    """The rows `record_answers` may update: the answers' own, and replaced versions on those engines."""
    ids = [i for answer in answers for i in answer.placement_ids]
    replaced = [and_(Placement.engine_id == engine_id, of_adapters(adapter_ids))
                for engine_id, adapter_ids in _replaced(answers).items()]
    return or_(Placement.id.in_(ids), *replaced)


def _differs(values: dict[str, str | None]) -> ColumnElement[bool]:
    """A row whose columns are not all `values` already (so an unchanged row is not rewritten)."""
    return or_(*(getattr(Placement, column).is_distinct_from(value) for column, value in values.items()))


def values_of(answer: EngineAnswer) -> dict[str, str | None]:
    """The columns the answer writes on its own rows."""
    values = {"observed": answer.observed.value, "last_error": answer.error}
    if answer.observed != ObservedState.LOADED:
        values["residency"] = None
    elif answer.residency is not None:
        values["residency"] = answer.residency[:16]
    return values


async def record_answers(session: AsyncSession, answers: Sequence[EngineAnswer]) -> None:
    """Write the answers on their rows, inside the caller's transaction (idempotent: safe to rerun)."""
    if not answers:
        return
    await lock_placements(session, _touched(answers))
    by_values: dict[tuple[tuple[str, str | None], ...], list[int]] = {}
    for answer in answers:
        by_values.setdefault(tuple(values_of(answer).items()), []).extend(answer.placement_ids)
    for values, ids in by_values.items():
        await session.execute(update(Placement).where(Placement.id.in_(ids), _differs(dict(values)))
                              .values(**dict(values)))
    answered = [i for answer in answers for i in answer.placement_ids]
    gone = {"observed": ObservedState.ABSENT.value, "last_error": None, "residency": None}
    for engine_id, adapter_ids in _replaced(answers).items():
        await session.execute(update(Placement).where(
            Placement.engine_id == engine_id, Placement.id.not_in(answered), of_adapters(adapter_ids),
            Placement.desired == DesiredState.ABSENT.value, _differs(gone),
        ).values(**gone))
