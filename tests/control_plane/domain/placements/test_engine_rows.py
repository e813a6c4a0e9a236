"""Which of a reconcile round's answers change a row (engine_rows.news): a steady round writes none of them."""

from __future__ import annotations

from control_plane.db.models import DesiredState, ObservedState
from control_plane.domain.placements.answers import EngineAnswer
from control_plane.domain.placements.engine_rows import EngineRow, news
from control_plane.domain.placements.loads import RecordedVersion

V = RecordedVersion(sha256="0" * 64, uri="/x", in_store=False, size_bytes=1)


def row(pid: int, adapter_id: int, desired: str, observed: str, error: str | None = None,
        residency: str | None = None) -> EngineRow:
    return EngineRow(pid, desired, observed, error, residency, adapter_id, f"a{adapter_id}", V)


def loaded(pid: int, adapter_id: int, residency: str | None = "host") -> EngineAnswer:
    return EngineAnswer(1, (pid,), ObservedState.LOADED, None, adapter_id, residency)


HELD, ABSENT = DesiredState.LOADED.value, DesiredState.ABSENT.value


def test_answers_the_rows_say_already_are_left_out() -> None:
    rows = [row(1, 10, HELD, "loaded", residency="host"), row(2, 11, ABSENT, "absent")]
    answers = [loaded(1, 10), EngineAnswer(1, (2,), ObservedState.ABSENT)]
    assert news(answers, rows) == []


def test_a_changed_column_or_an_unknown_row_is_written() -> None:
    rows = [row(1, 10, HELD, "loaded", residency="host"), row(2, 11, HELD, "failed", error="boom")]
    moved = loaded(1, 10, residency="device")
    recovered = loaded(2, 11)
    new_row = loaded(3, 12)
    assert news([moved, recovered, new_row], rows) == [
        EngineAnswer(1, (1,), ObservedState.LOADED, None, None, "device"),  # nothing else of a10 here
        EngineAnswer(1, (2,), ObservedState.LOADED, None, None, "host"),
        EngineAnswer(1, (3,), ObservedState.LOADED, None, None, "host"),  # a row the round did not read
    ]


def test_a_load_that_replaced_a_version_not_yet_seen_gone_keeps_its_replacement() -> None:
    rows = [row(1, 10, HELD, "loaded", residency="host"), row(2, 10, ABSENT, "loaded", residency="host")]
    assert news([loaded(1, 10)], rows) == [loaded(1, 10)]  # row 2 is still observed loaded: written gone
    rows[1] = row(2, 10, ABSENT, "absent")
    assert news([loaded(1, 10)], rows) == []
