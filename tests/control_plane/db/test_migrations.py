"""Alembic: empty → head → base on both databases, and head matches the ORM metadata exactly."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from advanced_alchemy.base import orm_registry
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

import control_plane.db.models  # noqa: F401
from control_plane import cli
from control_plane.db import migrate
from tests.control_plane.conftest import create_pg_database, drop_pg_database

TABLES = {"adapters", "adapter_versions", "engines", "placements", "audit_events", "artifact_blobs", "version_files",
          "demand_reports", "stats_samples", "routers", "tenants", "api_keys", "console_session_ends"}
HEAD = "0014_engine_kind"


@pytest.fixture(params=["sqlite", "postgresql"])
async def empty_db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'm.db'}"
        return
    request.getfixturevalue("pg_database")  # skips when PostgreSQL is unreachable
    url = await create_pg_database("lp_mig")  # its own database: this test drops every table
    yield url
    await drop_pg_database(url)


async def _tables(engine: AsyncEngine) -> set[str]:
    async with engine.connect() as conn:
        return set(await conn.run_sync(lambda c: inspect(c).get_table_names())) - {"alembic_version"}


async def test_upgrade_to_head_matches_models_then_downgrade_to_base(empty_db: str) -> None:
    engine = create_async_engine(empty_db)
    try:
        assert await migrate.current(engine) is None and await _tables(engine) == set()
        await migrate.upgrade(engine)
        assert await migrate.current(engine) == HEAD
        assert await _tables(engine) == TABLES
        async with engine.connect() as conn:
            diff = await conn.run_sync(lambda c: compare_metadata(
                MigrationContext.configure(c, opts={"compare_type": True}), orm_registry.metadata))
        assert diff == []
        await migrate.upgrade(engine)  # at head already: a no-op
        await migrate.downgrade(engine, "base")
        assert await migrate.current(engine) is None and await _tables(engine) == set()
    finally:
        await engine.dispose()


@pytest.mark.usefixtures("restore_logging")  # cli.main configures logging, on capsys' stderr
def test_cli_db_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    assert cli.main(["--database-url", url, "db", "current"]) == 0
    assert cli.main(["--database-url", url, "db", "upgrade"]) == 0
    assert cli.main(["--database-url", url, "db", "downgrade", "base"]) == 0
    assert capsys.readouterr().out.split() == ["base", "(empty)", HEAD, "base", "(empty)"]


@pytest.mark.usefixtures("restore_logging")  # cli.main configures logging, on capsys' stderr
def test_cli_refuses_to_serve_without_admin_tokens(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("LORAPLANE_ADMIN_TOKENS", raising=False)
    assert cli.main(["--port", "1"]) == 2
    assert "LORAPLANE_ADMIN_TOKENS" in capsys.readouterr().err


async def test_replicas_migrating_at_once_do_not_collide(empty_db: str) -> None:
    # PostgreSQL: the advisory lock lets one replica migrate while the others wait and then find head.
    engines = [create_async_engine(empty_db) for _ in range(3)]
    try:
        await asyncio.gather(*(migrate.upgrade(e) for e in engines))
        assert [await migrate.current(e) for e in engines] == [HEAD] * 3
    finally:
        for e in engines:
            await e.dispose()


def _legacy_and_manifest(folder: Path) -> tuple[str, str]:
    from importlib import import_module

    from shared.manifest import files_digest

    legacy = import_module("migrations.versions.0002_manifest_digest").legacy_sha256
    files = [folder / "adapter_config.json", folder / "adapter_model.safetensors"]
    return legacy(files), files_digest(files)


async def _insert_adapter(conn: AsyncConnection, name: str, now: dt.datetime) -> int:
    return (await conn.execute(text(
        "INSERT INTO adapters (name, base_model, description, labels, created_at, updated_at) "
        "VALUES (:name, 'demo', '', '{}', :now, :now) RETURNING id"), {"name": name, "now": now})).scalar_one()


async def _insert_engine(conn: AsyncConnection, name: str, now: dt.datetime) -> int:
    """An engine row with only the columns every revision has."""
    return (await conn.execute(text(
        "INSERT INTO engines (name, url, base_model, state, slots_total, slots_used, created_at, updated_at) "
        "VALUES (:name, 'http://10.0.0.1:1', 'demo', 'healthy', 4, 0, :now, :now) RETURNING id"),
        {"name": name, "now": now})).scalar_one()


async def test_0002_recomputes_digests_of_intact_versions_and_keeps_the_rest(empty_db: str, demo: dict,
                                                                             tmp_path: Path) -> None:
    intact, edited = tmp_path / "intact", tmp_path / "edited"
    shutil.copytree(demo["demo-short"], intact)
    shutil.copytree(demo["demo-poet"], edited)
    (intact_old, intact_new), (edited_old, _) = _legacy_and_manifest(intact), _legacy_and_manifest(edited)
    config = edited / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "lora_alpha": 4096}))  # edited after
    engine = create_async_engine(empty_db)
    try:
        await migrate.upgrade(engine, "0001")
        now = dt.datetime.now(dt.UTC)
        async with engine.begin() as conn:
            adapter_id = await _insert_adapter(conn, "a", now)
            for number, uri, sha in ((1, intact, intact_old), (2, edited, edited_old),
                                     (3, tmp_path / "gone", "f" * 64)):
                await conn.execute(text(
                    "INSERT INTO adapter_versions (adapter_id, number, uri, sha256, rank, alpha, target_modules, "
                    "size_bytes, created_at) VALUES (:a, :n, :uri, :sha, 4, 8, '[]', 1, :now)"),
                    {"a": adapter_id, "n": number, "uri": str(uri), "sha": sha, "now": now})

        async def digests() -> dict[int, str]:
            async with engine.connect() as conn:
                rows = await conn.execute(text("SELECT number, sha256 FROM adapter_versions"))
                return {n: sha for n, sha in rows}

        await migrate.upgrade(engine)
        assert await digests() == {1: intact_new, 2: edited_old, 3: "f" * 64}
        await migrate.downgrade(engine, "0001")
        assert await digests() == {1: intact_old, 2: edited_old, 3: "f" * 64}
    finally:
        await engine.dispose()


async def test_0004_marks_adapters_unloaded_before_it_as_unloaded(empty_db: str) -> None:
    engine = create_async_engine(empty_db)
    try:
        await migrate.upgrade(engine, "0003_artifact_store")
        now = dt.datetime.now(dt.UTC)
        async with engine.begin() as conn:
            engine_id = await _insert_engine(conn, "e", now)
            for name, desired in (("gone", "absent"), ("held", "loaded"), ("never", None)):
                adapter_id = await _insert_adapter(conn, name, now)
                version_id = (await conn.execute(text(
                    "INSERT INTO adapter_versions (adapter_id, number, uri, sha256, rank, alpha, target_modules, "
                    "size_bytes, created_at) VALUES (:a, 1, 'x', :sha, 4, 8, '[]', 1, :now) RETURNING id"),
                    {"a": adapter_id, "sha": "a" * 64, "now": now})).scalar_one()
                if desired is not None:
                    await conn.execute(text(
                        "INSERT INTO placements (engine_id, adapter_version_id, desired, observed, created_at, "
                        "updated_at) VALUES (:e, :v, :d, 'absent', :now, :now)"),
                        {"e": engine_id, "v": version_id, "d": desired, "now": now})
        await migrate.upgrade(engine)
        async with engine.connect() as conn:
            rows = dict((await conn.execute(text("SELECT name, scale_state FROM adapters"))).all())
        parsed = {n: json.loads(v) if isinstance(v, str) else v for n, v in rows.items()}
        assert parsed == {"gone": {"unloaded": True}, "held": None, "never": None}
    finally:
        await engine.dispose()


async def test_0014_engines_before_it_are_loraplane_engines_serving_inference_at_their_url(empty_db: str) -> None:
    engine = create_async_engine(empty_db)
    try:
        await migrate.upgrade(engine, "0013_console_session_ends")
        now = dt.datetime.now(dt.UTC)
        async with engine.begin() as conn:
            await _insert_engine(conn, "old", now)
        await migrate.upgrade(engine)
        async with engine.begin() as conn:
            await conn.execute(text(
                "INSERT INTO engines (name, url, kind, inference_url, base_model, state, slots_total, slots_used, "
                "created_at, updated_at) VALUES ('agent', 'http://10.0.0.2:1', 'vllm', 'http://10.0.0.2:8000', "
                "'demo', 'healthy', 4, 0, :now, :now)"), {"now": now})
            rows = (await conn.execute(text("SELECT name, kind, inference_url FROM engines ORDER BY name"))).all()
        assert [tuple(r) for r in rows] == [("agent", "vllm", "http://10.0.0.2:8000"), ("old", "loraplane", None)]
        await migrate.downgrade(engine, "0013_console_session_ends")
        async with engine.connect() as conn:
            columns = {c["name"] for c in await conn.run_sync(lambda c: inspect(c).get_columns("engines"))}
            names = (await conn.execute(text("SELECT name FROM engines ORDER BY name"))).scalars().all()
        assert not {"kind", "inference_url"} & columns and names == ["agent", "old"]
    finally:
        await engine.dispose()
