"""The fault suite's shared fleet: started once for tests/faults/ (the tests run in file order, each
leaving the fleet whole again), on a fresh PostgreSQL database that is dropped at the end.

Every test here is marked `faults` (`pytest -m faults`). Without a reachable PostgreSQL the suite
skips, unless the environment variable CI is set: then that is a failure.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import httpx
import pytest
from sqlalchemy.engine import make_url

from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model
from tests.e2e.test_control_plane_engines import engine_token
from tests.faults.driver import MAX_TOKENS, Driver, FaultLog, Timeline, check, complete
from tests.faults.fleet import ENGINE_ADMIN, PG_URL, RECONCILE_S, Fleet, pg_run

HERE = Path(__file__).parent
# An answer is judged correct within 2 reconcile intervals, plus what the test's own polling and one
# engine call can add on a loaded 2-core CI machine.
CONVERGE_WITHIN_S = 2 * RECONCILE_S + 1.5


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.faults)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "faults: the fault-injection suite (real processes, PostgreSQL)")


@dataclass
class Scenario:
    """The fleet plus what the tests learn about it as they go."""

    fleet: Fleet
    folders: dict[str, Path]  # folder key -> adapter folder
    expected: dict[str, str]  # folder key -> greedy text; "base" -> the base model's
    timeline: Timeline = field(default_factory=Timeline)
    faults: FaultLog = field(default_factory=FaultLog)
    # adapter -> the active version (None: unloaded) that its last acknowledged change set
    acknowledged: dict[str, int | None] = field(default_factory=dict)
    driver: Driver | None = None

    def engine_urls(self) -> dict[str, str]:
        return {name: proc.url for name, proc in self.fleet.engines.items()}

    def violations(self) -> list[str]:
        assert self.driver is not None
        return check(self.driver.outcomes, self.timeline, self.expected, self.faults)

    def status_counts(self) -> dict[str, int]:
        assert self.driver is not None
        counts: dict[str, int] = {}
        for o in self.driver.outcomes:
            key = str(o.status or o.error)
            counts[key] = counts.get(key, 0) + 1
        return counts


def _database() -> str:
    """A fresh database on the test server, its URL; skips (fails under CI) when there is no server."""
    name = f"faults_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    try:
        pg_run(PG_URL, f'CREATE DATABASE "{name}"')
    except (OSError, asyncpg.PostgresError) as exc:  # refused, unreachable, or no such role
        if os.environ.get("CI") or os.environ.get("LORAPLANE_TEST_REQUIRE_PG") == "1":
            raise
        pytest.skip(f"PostgreSQL not reachable at {make_url(PG_URL).render_as_string()}: {exc}")
    return make_url(PG_URL).set(database=name).render_as_string(hide_password=False)


def _record_expected(fleet: Fleet, folders: dict[str, Path]) -> dict[str, str]:
    """Each folder's greedy answer, from engine e1 before any traffic (loaded there directly, then
    unloaded again so the control plane never sees these names)."""
    e1 = fleet.engines["e1"].url
    admin = httpx.Client(headers={"Authorization": f"Bearer {engine_token('e1', ENGINE_ADMIN)}"}, timeout=60)
    expected = {"base": complete(fleet.plain, e1, "demo").json()["choices"][0]["text"]}
    for i, (key, folder) in enumerate(folders.items()):
        name = f"probe-{i}"
        r = admin.post(e1 + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)})
        assert r.status_code == 200, r.text
        expected[key] = complete(fleet.plain, e1, name).json()["choices"][0]["text"]
        assert admin.post(e1 + "/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200
    admin.close()
    # the check can only tell versions apart if their answers differ
    assert len(set(expected.values())) == len(expected), f"{MAX_TOKENS} tokens do not tell {expected} apart"
    return expected


@pytest.fixture(scope="package")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    tmp = tmp_path_factory.mktemp("faults")
    base = tmp / "models" / "demo"
    write_demo_model(base, seed=0)
    root = tmp / "adapters"
    folders: dict[str, Path] = {}
    for seed in (0, 1, 2):  # versions of one name: the same adapter kind, other weights
        names = ["demo-pirate"] if seed == 2 else None
        for name, path in write_demo_adapters(base, root / f"s{seed}", seed=seed, names=names).items():
            folders[f"s{seed}/{name}"] = path
    db_url = _database()
    fleet = Fleet(tmp, db_url, base, root)
    try:
        fleet.start()
        yield Scenario(fleet, folders, _record_expected(fleet, folders))
    finally:
        fleet.stop()
        pg_run(PG_URL, f'DROP DATABASE IF EXISTS "{make_url(db_url).database}" WITH (FORCE)')


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # noqa: ANN201
    """A failed fault test's report carries the end of every fleet process's log (engines log at info),
    heartbeats left out: what each process did around the failure, for a failure seen only in CI."""
    outcome = yield
    report = outcome.get_result()
    scenario = getattr(item, "funcargs", {}).get("scenario")
    if report.failed and isinstance(scenario, Scenario):
        for proc in [*scenario.fleet.cps, *scenario.fleet.engines.values()]:
            with contextlib.suppress(OSError):
                lines = [ln for ln in proc.log.read_text(errors="replace").splitlines() if "heartbeat" not in ln]
                report.sections.append((f"log of {proc.name} ({proc.log.name})", "\n".join(lines[-25:])))
