"""A fleet of real processes for the fault suite: two control-plane replicas on one PostgreSQL database and
three engines, all on 127.0.0.1, each a `loraplane` subprocess the tests can signal, kill and restart.

Engines heartbeat to replica 1 (`cps[1]`); admin calls go to either. The replica a test kills is
replica 0, so the survivor keeps the engines healthy and its reconciler converges them. Secrets travel
in the environment only. Every process is stopped by `Fleet.stop()` (the fixture calls it on failure too).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import httpx
import pytest
from sqlalchemy.engine import make_url

from tests.data_plane.api.conftest import REPO_ROOT, SERVED_NAME, EngineServer, _wait_until_serving
from tests.e2e.test_control_plane_engines import _free_port as free_port
from tests.e2e.test_control_plane_engines import engine_token

# ENGINE_ADMIN: the control plane's engine secret, which each engine's admin token is derived from
ADMIN, READ, ENGINE_ADMIN = "faults-admin-token", "faults-read-token", "faults-engine-secret"
RECONCILE_S = 1.0  # LORAPLANE_RECONCILE_INTERVAL_S: "converged within 2 intervals" is 2 s
HEARTBEAT_S = 3.0  # data_plane.control_client.HEARTBEAT_S
STALE_AFTER_S = 7.0  # two missed heartbeats and a bit
ENGINE_TIMEOUT_S = 3.0
ENGINE_FLAGS = ("--max-model-len", "512", "--num-kv-blocks", "96", "--max-num-seqs", "8", "--max-loras", "4",
                "--num-threads", "1", "--shutdown-timeout-s", "20", "--log-level", "info",
                # several engines on one host: auto would bind every core to the same last CPU
                "--omp-threads-bind", "nobind")
PG_URL = os.environ.get("LORAPLANE_TEST_PG_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")


def pg_dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def pg_run(url: str, sql: str, *args: object) -> list[asyncpg.Record]:
    async def go() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(pg_dsn(url), timeout=5)
        try:
            return await conn.fetch(sql, *args)
        finally:
            await conn.close()

    return asyncio.run(go())


@dataclass
class Proc:
    """One subprocess of the fleet; `start()` again after a kill is a restart (new log file)."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    logs: Path
    process: subprocess.Popen | None = None
    url: str = ""
    starts: int = 0
    log: Path = field(init=False, default=Path())

    def spawn(self) -> None:
        self.log = self.logs / f"{self.name}-{self.starts}.log"
        self.starts += 1
        with self.log.open("w") as out:
            self.process = subprocess.Popen(self.cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                            env=self.env)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def kill(self) -> None:
        if self.alive:
            assert self.process is not None
            self.process.kill()
            self.process.wait(timeout=30)

    def stop(self, timeout_s: float = 30) -> None:
        if not self.alive:
            return
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


class Fleet:
    def __init__(self, tmp: Path, db_url: str, base: Path, adapter_root: Path, engines: int = 3) -> None:
        self.db_url = db_url
        self.base = base
        self.logs = tmp / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        names = [f"e{i + 1}" for i in range(engines)]
        self.engine_tokens = {n: f"faults-engine-{n}-token" for n in names}
        common = {**os.environ, "PYTHONUNBUFFERED": "1"}
        cp_env = {
            **common, "LORAPLANE_ADMIN_TOKENS": ADMIN, "LORAPLANE_READ_TOKENS": READ,
            # both names of the engines' admin-token secret (the old one is kept as an alias)
            "LORAPLANE_ENGINE_TOKEN": ENGINE_ADMIN, "LORAPLANE_ENGINE_ADMIN_TOKEN": ENGINE_ADMIN,
            "LORAPLANE_DATABASE_URL": db_url, "LORAPLANE_RECONCILE_INTERVAL_S": str(RECONCILE_S),
            "LORAPLANE_ENGINE_STALE_AFTER_S": str(STALE_AFTER_S), "LORAPLANE_ENGINE_TIMEOUT_S": str(ENGINE_TIMEOUT_S),
            "LORAPLANE_LOG_LEVEL": "warning",
            # every adapter on every engine (the faults and their invariants are about each engine
            # converging, not about which engines replica placement would choose)
            "LORAPLANE_DEFAULT_MIN_REPLICAS": str(engines), "LORAPLANE_DEFAULT_MAX_REPLICAS": "all",
            # one artifact store for both replicas, as they share one database
            "LORAPLANE_ARTIFACT_STORE": (tmp / "artifacts").as_uri(),
            # each engine calls the control plane with its own token, valid for its name only
            "LORAPLANE_ENGINE_CREDENTIALS": ",".join(f"{n}={t}" for n, t in self.engine_tokens.items()),
        }
        self.cps: list[Proc] = []
        for i in range(2):
            port = free_port()
            proc = Proc(f"cp{i}", [sys.executable, "-m", "shared.cli", "control", "--host", "127.0.0.1",
                                   "--port", str(port), "--lora-roots", str(adapter_root)], cp_env, self.logs)
            proc.url = f"http://127.0.0.1:{port}"
            self.cps.append(proc)
        self.engines: dict[str, Proc] = {}
        for name in names:
            env = {**common, "LORAPLANE_ADMIN_TOKEN": engine_token(name, ENGINE_ADMIN),
                   "LORAPLANE_CONTROL_PLANE_TOKEN": self.engine_tokens[name]}
            cmd = [sys.executable, "-m", "shared.cli", "engine", "--model", str(base), "--served-model-name",
                   SERVED_NAME, "--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--enable-lora",
                   "--lora-roots", str(adapter_root), "--control-plane", self.cps[1].url, "--engine-name", name,
                   # kept across its restarts (a SIGKILL would leave a default temporary one behind)
                   "--lora-cache-dir", str(tmp / "lora-cache" / name), *ENGINE_FLAGS]
            self.engines[name] = Proc(name, cmd, env, self.logs)
        self.admin = httpx.Client(headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
        self.reader = httpx.Client(headers={"Authorization": f"Bearer {READ}"}, timeout=30)
        self.plain = httpx.Client(timeout=30)

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        # Replica 0 applies the migrations alone (the second finds them applied) while the engines load;
        # they retry their registration until replica 1 answers.
        self.cps[0].spawn()
        for proc in self.engines.values():
            proc.spawn()
        self.wait_cp_up(0)
        self.start_cp(1)
        for name in self.engines:
            self.wait_engine_up(name)

    def stop(self) -> None:
        for proc in [*self.engines.values(), *self.cps]:
            proc.stop()
        for client in (self.admin, self.reader, self.plain):
            client.close()

    def start_cp(self, i: int) -> None:
        self.cps[i].spawn()
        self.wait_cp_up(i)

    def wait_cp_up(self, i: int) -> None:
        proc = self.cps[i]
        deadline = time.monotonic() + 60
        while True:
            if not proc.alive or time.monotonic() > deadline:
                pytest.fail(f"control plane {proc.name} did not start:\n{proc.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if self.plain.get(proc.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)

    def start_engine(self, name: str) -> None:
        self.engines[name].spawn()
        self.wait_engine_up(name)

    def wait_engine_up(self, name: str) -> None:
        """Serving, and registered (healthy) at the control plane under its current URL."""
        proc = self.engines[name]
        assert proc.process is not None
        proc.url = _wait_until_serving(EngineServer("", proc.process, proc.log))
        self.wait_for(lambda: self.engine_rows().get(name, {}).get("url") == proc.url
                      and self.engine_rows()[name]["state"] == "healthy", f"{name} to register", timeout_s=30)

    # ---- reads ---------------------------------------------------------------------------------
    def engine_rows(self, cp: int = 1) -> dict[str, dict]:
        return {e["name"]: e for e in self.reader.get(self.cps[cp].url + "/v1/engines").json()["data"]}

    def adapter(self, name: str, cp: int = 1) -> dict:
        r = self.reader.get(self.cps[cp].url + f"/v1/lora_adapters/{name}")
        assert r.status_code == 200, r.text
        return r.json()

    def registry(self, cp: int = 1) -> dict[str, dict]:
        page = self.reader.get(self.cps[cp].url + "/v1/lora_adapters", params={"limit": 500}).json()
        return {a["name"]: self.adapter(a["name"], cp) for a in page["data"]}

    def listing(self, engine: str, timeout_s: float = 5) -> dict:
        return self.plain.get(self.engines[engine].url + "/v1/lora_adapters", timeout=timeout_s,
                              headers={"Authorization": f"Bearer {engine_token(engine, ENGINE_ADMIN)}"}).json()

    def engine_metric(self, engine: str, metric: str) -> float:
        text = self.plain.get(self.engines[engine].url + "/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith(metric + " "):
                return float(line.split()[1])
        raise KeyError(metric)

    # ---- admin calls ---------------------------------------------------------------------------
    def load(self, name: str, path: Path, cp: int = 0, **extra: object) -> httpx.Response:
        body = {"lora_name": name, "lora_path": str(path), "base_model": SERVED_NAME, **extra}
        return self.admin.post(self.cps[cp].url + "/v1/load_lora_adapter", json=body)

    def activate(self, name: str, version: int, cp: int = 0) -> httpx.Response:
        return self.admin.post(self.cps[cp].url + f"/v1/lora_adapters/{name}/activate", json={"version": version})

    def unload(self, name: str, cp: int = 0) -> httpx.Response:
        return self.admin.post(self.cps[cp].url + "/v1/unload_lora_adapter", json={"lora_name": name})

    # ---- faults ----------------------------------------------------------------------------------
    def terminate_db_connections(self) -> int:
        """pg_terminate_backend on every connection to the fleet's database but this one; how many."""
        rows = pg_run(self.db_url, "SELECT pg_terminate_backend(pid) AS done FROM pg_stat_activity "
                      "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        return sum(bool(r["done"]) for r in rows)

    # ---- convergence -----------------------------------------------------------------------------
    def live_engines(self) -> list[str]:
        return [n for n, p in self.engines.items() if p.alive]

    def divergence(self) -> list[str]:
        """What keeps the fleet from desired == observed, on every live engine; [] when converged.

        Per engine: each adapter with a placement desired loaded/pinned is listed by the engine, ready,
        with that version's sha256, and observed `loaded`; nothing else is listed; placements desired
        absent are observed absent. Also every live engine is healthy at the control plane."""
        problems: list[str] = []
        rows = self.engine_rows()
        registry = self.registry()
        for engine in self.live_engines():
            if rows.get(engine, {}).get("state") != "healthy" or rows[engine]["url"] != self.engines[engine].url:
                problems.append(f"{engine}: not registered healthy at its url ({rows.get(engine)})")
                continue
            try:
                listed = {a["name"]: a for a in self.listing(engine, timeout_s=2)["adapters"]
                          if a["state"] != "draining"}
            except httpx.HTTPError as exc:
                problems.append(f"{engine}: listing failed ({type(exc).__name__})")
                continue
            wanted: set[str] = set()
            for name, detail in registry.items():
                sha = {v["number"]: v["sha256"] for v in detail["versions"]}
                for p in detail["placements"]:
                    if p["engine"] != engine:
                        continue
                    if p["desired"] in ("loaded", "pinned"):
                        wanted.add(name)
                        have = listed.get(name)
                        if have is None or have["state"] != "ready" or have["sha256"] != sha[p["version"]]:
                            problems.append(f"{engine}: {name} v{p['version']} desired, engine has "
                                            f"{None if have is None else (have['state'], have['version'])}")
                        if p["observed"] != "loaded":
                            problems.append(f"{engine}: {name} v{p['version']} observed {p['observed']}")
                    elif p["observed"] not in ("absent",):
                        problems.append(f"{engine}: {name} v{p['version']} desired absent, observed {p['observed']}")
            problems += [f"{engine}: holds {n} that no placement wants" for n in sorted(set(listed) - wanted)]
        return problems

    def wait_converged(self, within_s: float, what: str) -> float:
        """Poll until divergence() is empty; fail naming what still differs after `within_s`. Returns
        the seconds it took."""
        start = time.monotonic()
        while True:
            problems = self.divergence()
            if not problems:
                return time.monotonic() - start
            if time.monotonic() - start > within_s:
                pytest.fail(f"not converged {within_s:.1f}s after {what}: {problems}")
            time.sleep(0.1)

    @staticmethod
    def wait_for(predicate, what: str, timeout_s: float = 30) -> float:  # noqa: ANN001
        start = time.monotonic()
        while True:
            with contextlib.suppress(httpx.HTTPError, KeyError):
                if predicate():
                    return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
            time.sleep(0.1)
