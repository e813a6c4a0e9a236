"""A PostgreSQL connection terminated under a call (`pg_terminate_backend`, as a failover or a restart
does) is retried on a fresh connection where that is safe, and otherwise answers a documented 503 in the
OpenAI error shape; never a 500 (asyncpg's ConnectionDoesNotExistError must not go out as one).

The killer is deterministic: a listener on the app's own engine terminates, for real, the backend of the
connection that is about to run the n-th statement from now (or to COMMIT), and waits until it is gone.
Every position in each call is tried in turn, so each statement of a read, an audited mutation, a
heartbeat and an engine's resolve meets a dead connection once.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
from litestar.testing import AsyncTestClient
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from control_plane.app import create_app
from control_plane.settings import ControlPlaneSettings
from tests.control_plane.conftest import _truncate, admin, reader, run_blocking
from tests.control_plane.domain.adapters.helpers import add_engines, audit

MAX_STATEMENTS = 16  # more than any of these calls runs


def _dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


async def _terminate(url: str, pid: int | None) -> int:
    """Terminate backend `pid` (None: every backend of the database but this one), waiting until it is gone."""
    conn = await asyncpg.connect(_dsn(url), timeout=5)
    try:
        if pid is not None:
            return int(await conn.fetchval("SELECT pg_terminate_backend($1, 5000)::int", pid))
        return int(await conn.fetchval(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 5000)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"))
    finally:
        await conn.close()


class Killer:
    """Terminates the app's connection right before its n-th statement from `arm` (or before COMMIT)."""

    def __init__(self, engine: AsyncEngine, url: str) -> None:
        self.url = url
        self.countdown: int | None = None  # statements to let through, then kill
        self.every = False  # kill before every statement (a database that keeps failing)
        self.on_commit = False
        self.on_rollback = False  # the rollback of a request's session as it is closed after the handler
        self.kills = 0
        event.listen(engine.sync_engine, "before_cursor_execute", self._statement)
        event.listen(engine.sync_engine, "commit", self._commit)
        event.listen(engine.sync_engine, "rollback", self._rollback)

    def arm(self, nth: int | None = None, *, every: bool = False, on_commit: bool = False,
            on_rollback: bool = False) -> None:
        self.countdown, self.every, self.on_commit, self.kills = nth, every, on_commit, 0
        self.on_rollback = on_rollback

    def _kill(self, conn) -> None:  # noqa: ANN001
        pid = conn.connection.dbapi_connection._connection.get_server_pid()
        assert run_blocking(_terminate, self.url, pid) == 1
        self.kills += 1

    def _statement(self, conn, *_args) -> None:  # noqa: ANN001, ANN002
        if self.every:
            self._kill(conn)
        elif self.countdown is not None:
            self.countdown -= 1
            if self.countdown == 0:
                self.countdown = None
                self._kill(conn)

    def _commit(self, conn) -> None:  # noqa: ANN001
        if self.on_commit:
            self.on_commit = False
            self._kill(conn)

    def _rollback(self, conn) -> None:  # noqa: ANN001
        if self.on_rollback:
            self.on_rollback = False
            self._kill(conn)


@pytest.fixture
def pg_settings(pg_database: str, demo: dict[str, Path], tmp_path: Path) -> Iterator[ControlPlaneSettings]:
    run_blocking(_truncate, pg_database)
    yield ControlPlaneSettings(database_url=pg_database, admin_tokens=("admin-token-for-tests",),
                               read_tokens=("read-token-for-tests",), adapter_roots=(str(demo["root"]),),
                               artifact_store=(tmp_path / "artifacts").as_uri())


@pytest.fixture
async def cp(pg_settings: ControlPlaneSettings) -> AsyncIterator[tuple[AsyncTestClient, Killer]]:
    app = create_app(dataclasses.replace(pg_settings, reconcile_interval_s=3600))
    killer = Killer(app.state.audit_sessions.kw["bind"], pg_settings.database_url)
    async with AsyncTestClient(app=app) as client:
        yield client, killer


def _unavailable(r) -> None:  # noqa: ANN001
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["type"] == "service_unavailable" and "retry" in error["message"].lower(), error


async def _setup(client: AsyncTestClient, demo: dict, url: str) -> None:
    for folder in (demo["demo-pirate"], demo["demo-poet"]):
        r = await client.post("/v1/load_lora_adapter", headers=admin(),
                              json={"lora_name": "alpha", "lora_path": str(folder), "base_model": "demo"})
        assert r.status_code == 200, r.text
    await add_engines(url, ("e1", "demo", "healthy"))  # after the loads: nobody answers at its address


async def _forget_placements(url: str) -> None:
    """So that each resolve for e1 writes its placement again (the adopt path, not just the read)."""
    conn = await asyncpg.connect(_dsn(url), timeout=5)
    try:
        await conn.execute("DELETE FROM placements")
    finally:
        await conn.close()


CALLS = {  # name: (method, path, json body, token)
    "get adapter": ("GET", "/v1/lora_adapters/alpha", None, reader()),
    "list adapters": ("GET", "/v1/lora_adapters", None, reader()),
    "activate": ("POST", "/v1/lora_adapters/alpha/activate", {"version": 1}, admin()),
    "heartbeat": ("POST", "/v1/engines/e1/heartbeat", {}, admin()),
    "resolve for an engine": ("GET", "/v1/resolve/alpha?engine=e1", None, admin()),
    "list engines": ("GET", "/v1/engines", None, reader()),
}


@pytest.mark.parametrize("call", list(CALLS))
async def test_connection_terminated_at_each_statement_is_retried(
        cp: tuple[AsyncTestClient, Killer], demo: dict, pg_settings: ControlPlaneSettings, call: str) -> None:
    client, killer = cp
    await _setup(client, demo, pg_settings.database_url)
    method, path, body, token = CALLS[call]
    baseline = await client.request(method, path, json=body, headers=token)
    assert baseline.status_code == 200, baseline.text
    positions = 0
    for nth in range(1, MAX_STATEMENTS + 1):
        if call == "resolve for an engine":
            await _forget_placements(pg_settings.database_url)
        killer.arm(nth)
        r = await client.request(method, path, json=body, headers=token)
        if killer.kills == 0:  # the call ran fewer than nth statements: every position was tried
            break
        positions += 1
        assert r.status_code == 200, f"{call}, connection terminated before statement {nth}: {r.text}"
        if method == "GET":
            assert r.json() == baseline.json() or path.startswith("/v1/engines")  # heartbeat times differ
    else:
        pytest.fail(f"{call} ran more than {MAX_STATEMENTS} statements")
    assert positions >= 1
    killer.arm()
    assert (await client.get("/health")).status_code == 200


async def test_connections_terminated_between_calls_are_replaced(
        cp: tuple[AsyncTestClient, Killer], demo: dict, pg_settings: ControlPlaneSettings) -> None:
    client, _ = cp
    await _setup(client, demo, pg_settings.database_url)
    for _ in range(3):
        assert run_blocking(_terminate, pg_settings.database_url, None) >= 1  # the app's pooled connections
        for name, (method, path, body, token) in CALLS.items():
            if name == "activate":
                continue  # after the resolve, e1 holds alpha and an activation's push to it fails (502)
            r = await client.request(method, path, json=body, headers=token)
            assert r.status_code == 200, f"{method} {path}: {r.text}"


async def test_a_commit_cut_off_answers_503_for_a_mutation_and_is_retried_for_a_heartbeat(
        cp: tuple[AsyncTestClient, Killer], demo: dict, pg_settings: ControlPlaneSettings) -> None:
    client, killer = cp
    await _setup(client, demo, pg_settings.database_url)
    killer.arm(on_commit=True)  # the COMMIT may or may not have reached the server: never replayed
    r = await client.post("/v1/lora_adapters/alpha/activate", json={"version": 1}, headers=admin())
    _unavailable(r)
    assert "may or may not have been applied" in r.json()["error"]["message"]
    assert killer.kills == 1
    assert ("activate_lora_adapter", "alpha@1", "503 service_unavailable") in await audit(pg_settings.database_url)
    killer.arm(on_commit=True)  # a heartbeat says the same again: safe to replay
    r = await client.post("/v1/engines/e1/heartbeat", json={}, headers=admin())
    assert r.status_code == 200 and killer.kills == 1, r.text
    # the registry is whole: reads answer, and the activation retried by the client goes through
    r = await client.post("/v1/lora_adapters/alpha/activate", json={"version": 1}, headers=admin())
    assert r.status_code == 200 and r.json()["active_version"] == 1, r.text


async def test_a_connection_terminated_after_the_last_statement_keeps_the_answer(
        cp: tuple[AsyncTestClient, Killer], demo: dict, pg_settings: ControlPlaneSettings) -> None:
    """The handler is done and its answer built; the server then ends the connection, so the rollback
    that closing the request's session sends fails, which must not turn the answer into a 500. The answer
    stands, and the broken connection is discarded rather than returned to the pool."""
    client, killer = cp
    await _setup(client, demo, pg_settings.database_url)
    for call in ("get adapter", "list adapters", "list engines"):  # reads: their transaction is still open
        method, path, body, token = CALLS[call]
        killer.arm(on_rollback=True)
        r = await client.request(method, path, json=body, headers=token)
        assert killer.kills == 1, f"{path}: the close sent no rollback, so nothing was tested"
        assert r.status_code == 200, f"{path}: {r.text}"
        killer.arm()
        assert (await client.request(method, path, json=body, headers=token)).status_code == 200


async def test_a_database_that_keeps_failing_answers_503_never_500(
        cp: tuple[AsyncTestClient, Killer], demo: dict, pg_settings: ControlPlaneSettings) -> None:
    client, killer = cp
    await _setup(client, demo, pg_settings.database_url)
    killer.arm(every=True)
    for method, path, body, token in [*CALLS.values(), ("GET", "/v1/lora_stats", None, reader())]:
        r = await client.request(method, path, json=body, headers=token)
        _unavailable(r)  # lora_stats has no retry of its own: the app's handler answers 503
        assert killer.kills >= 1
    killer.arm()
    r = await client.get("/v1/lora_adapters/alpha", headers=reader())
    assert r.status_code == 200 and r.json()["active_version"] == 2, r.text


async def test_killer_really_kills(pg_settings: ControlPlaneSettings) -> None:
    """The harness itself: a terminated backend is gone (so the tests above meet a dead connection)."""
    conn = await asyncpg.connect(_dsn(pg_settings.database_url), timeout=5)
    try:
        pid = conn.get_server_pid()
        assert await asyncio.to_thread(run_blocking, _terminate, pg_settings.database_url, pid) == 1
        with pytest.raises((asyncpg.PostgresConnectionError, asyncpg.InterfaceError, OSError)):
            await conn.fetchval("SELECT 1")
    finally:
        conn.terminate()
