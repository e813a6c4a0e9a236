"""A damaged SQLite database stops the control plane's start with a clear message: a file whose pages
were overwritten must not start and answer /health 200 (`SELECT 1` needs no table)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from control_plane.db import migrate
from tests.data_plane.api.conftest import REPO_ROOT
from tests.e2e.test_control_plane_engines import _free_port as free_port


async def _migrated(path: Path) -> None:
    engine = create_async_engine(f"sqlite+aiosqlite:///{path}")
    try:
        await migrate.upgrade(engine)
        async with engine.begin() as conn:  # some rows, so the tables' pages hold data
            for i in range(2000):
                await conn.execute(text("INSERT INTO audit_events (actor, action, target, outcome, at) "
                                        "VALUES (:a, 'x', 'y', 'ok', CURRENT_TIMESTAMP)"), {"a": f"actor-{i}"})
    finally:
        await engine.dispose()


def _damage(path: Path) -> None:
    """Overwrite part of the file (past the schema's pages, among the rows' pages) with junk, as a bad
    disk or a copy of a file being written would."""
    data = bytearray(path.read_bytes())
    assert len(data) > 16 * 4096
    start = len(data) * 3 // 4
    data[start:start + 2048] = os.urandom(2048)
    path.write_bytes(bytes(data))


async def test_a_healthy_database_passes(tmp_path: Path) -> None:
    path = tmp_path / "ok.db"
    await _migrated(path)
    engine = create_async_engine(f"sqlite+aiosqlite:///{path}")
    try:
        await migrate.check_integrity(engine)
    finally:
        await engine.dispose()


@pytest.mark.parametrize("how", ["damaged pages", "not a database"])
async def test_a_corrupt_database_is_refused_naming_what_to_do(tmp_path: Path, how: str) -> None:
    path = tmp_path / "control.db"
    if how == "damaged pages":
        await _migrated(path)
        _damage(path)
    else:
        path.write_bytes(b"this is not an SQLite file" * 500)
    engine = create_async_engine(f"sqlite+aiosqlite:///{path}")
    try:
        with pytest.raises(migrate.DatabaseCorruptError, match=r"(?s)is corrupt .*restore it\s+from a backup"):
            await migrate.check_integrity(engine)
    finally:
        await engine.dispose()


async def test_loraplane_control_does_not_start_on_a_corrupt_database(tmp_path: Path) -> None:
    path = tmp_path / "control.db"
    await _migrated(path)
    _damage(path)
    env = {**os.environ, "LORAPLANE_ADMIN_TOKENS": "adm"}
    cmd = [sys.executable, "-m", "shared.cli", "control", "--port", str(free_port()), "--database-url",
           f"sqlite+aiosqlite:///{path}"]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "is corrupt" in done.stdout + done.stderr
