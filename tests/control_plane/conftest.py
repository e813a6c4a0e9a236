"""Fixtures for the control-plane tests: every app test runs on SQLite and on PostgreSQL.

PostgreSQL (127.0.0.1:5432, trust auth; LORAPLANE_TEST_PG_URL overrides) gets a fresh, uniquely named
database per test session, dropped at the end; between tests its tables are truncated, so neither
parallel runs nor a failed test leak state. Without a reachable server the PostgreSQL cases skip,
unless LORAPLANE_TEST_REQUIRE_PG=1 (CI) makes that an error.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import asyncpg
import httpx
import pytest
from litestar.testing import AsyncTestClient
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from control_plane.app import create_app
from control_plane.db.migrate import upgrade
from control_plane.settings import ControlPlaneSettings

ADMIN = "admin-token-for-tests"
KEY_PEPPER = "key-pepper-for-tests-" + "p" * 32
READ = "read-token-for-tests"
PG_URL = os.environ.get("LORAPLANE_TEST_PG_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")
TABLES = ("api_keys", "tenants", "demand_reports", "console_session_ends", "routers", "stats_samples", "audit_events", "placements", "version_files", "artifact_blobs", "adapter_versions", "adapters", "engines")


def admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}


def reader() -> dict[str, str]:
    return {"Authorization": f"Bearer {READ}"}


def run_blocking(coro_fn, *args):  # noqa: ANN001, ANN201
    """Run an async helper to completion from sync code, even where an event loop is already running
    (a sync fixture requested by an async one): on a thread of its own, with a loop of its own."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro_fn(*args)).result()


def _dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


async def create_pg_database(prefix: str = "lp_cp") -> str:
    """A new empty database on the test server; its SQLAlchemy URL."""
    name = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(_dsn(PG_URL), timeout=5)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return make_url(PG_URL).set(database=name).render_as_string(hide_password=False)


async def drop_pg_database(url: str) -> None:
    conn = await asyncpg.connect(_dsn(PG_URL), timeout=5)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)')
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    try:
        url = run_blocking(create_pg_database)
    except (OSError, asyncpg.PostgresError) as exc:
        if os.environ.get("LORAPLANE_TEST_REQUIRE_PG") == "1":
            raise
        pytest.skip(f"PostgreSQL not reachable at {make_url(PG_URL).render_as_string()}: {exc}")
    yield url
    run_blocking(drop_pg_database, url)


async def _truncate(url: str) -> None:
    conn = await asyncpg.connect(_dsn(url), timeout=5)
    try:
        present = {r["tablename"] for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname='public'")}
        tables = [t for t in TABLES if t in present]
        if tables:
            await conn.execute(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE")
    finally:
        await conn.close()


async def _migrate(url: str) -> None:
    engine = create_async_engine(url)
    try:
        await upgrade(engine)
    finally:
        await engine.dispose()


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty SQLite database at the migrations' head, made once per session: each test gets a copy, which
    the app finds at head, instead of running every migration again on an empty file."""
    path = tmp_path_factory.mktemp("migrated") / "control.db"
    run_blocking(_migrate, f"sqlite+aiosqlite:///{path}")
    return path


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        shutil.copyfile(request.getfixturevalue("migrated_sqlite"), tmp_path / "control.db")
        yield f"sqlite+aiosqlite:///{tmp_path / 'control.db'}"
        return
    url = request.getfixturevalue("pg_database")
    run_blocking(_truncate, url)
    yield url


@pytest.fixture(scope="session")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The demo base model and its demo adapters (written once per session): name -> folder, plus 'root'."""
    from data_plane.demo.adapters import write_demo_adapters
    from data_plane.demo.model_builder import write_demo_model

    root = tmp_path_factory.mktemp("adapters")
    base = root / "base"
    write_demo_model(base, seed=0)
    paths = write_demo_adapters(base, root / "demo")
    return {"root": root, "base": base, **paths}


@pytest.fixture
def settings(db_url: str, demo: dict[str, Path], tmp_path: Path) -> ControlPlaneSettings:
    return ControlPlaneSettings(database_url=db_url, admin_tokens=(ADMIN,), read_tokens=(READ,),
                                adapter_roots=(str(demo["root"]),), artifact_store=(tmp_path / "artifacts").as_uri(),
                                key_pepper=KEY_PEPPER, data_dir=str(tmp_path / "data"))


@pytest.fixture
async def client(settings: ControlPlaneSettings) -> AsyncIterator[AsyncTestClient]:
    async with AsyncTestClient(app=create_app(settings)) as c:
        yield c


@pytest.fixture
async def concurrent_client(settings: ControlPlaneSettings) -> AsyncIterator[httpx.AsyncClient]:
    """The app in the test's own event loop behind httpx's ASGI transport: unlike AsyncTestClient (one
    request at a time, on a portal thread), gathered requests here really interleave inside the app."""
    app = create_app(settings)
    started, stop = asyncio.Event(), asyncio.Event()

    async def hold_lifespan() -> None:
        # Entered and exited in one task: the lifespan's anyio task group insists on that, while pytest
        # sets a fixture up and tears it down in different tasks.
        async with app.lifespan():
            started.set()
            await stop.wait()

    holder = asyncio.create_task(hold_lifespan())
    await asyncio.wait([holder, asyncio.create_task(started.wait())], return_when=asyncio.FIRST_COMPLETED)
    if holder.done():
        holder.result()  # startup failed: raise its error
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
        yield c
    stop.set()
    await holder
