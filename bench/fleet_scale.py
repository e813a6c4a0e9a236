"""The control plane at fleet scale, by simulation. Prints one JSON object; progress on stderr.

    flock /tmp/iss/bench.lock timeout 1200 .venv/bin/python bench/fleet_scale.py [--engines 200] [--adapters 100000]

The REAL control plane (`loraplane control`, as a process, on PostgreSQL at --postgres, in a fresh database
`fleet_scale_<pid>` dropped at the end) against --engines SIMULATED engines (bench/engine_sim.py: one light
process answering many engines' admin endpoints on loopback and sending their heartbeats; a simulator, not
an engine) and --adapters adapters with replicas {min 1, max 3}.

Registering adapters: --api-adapters of them go through the real API (`POST /v1/load_lora_adapter` of a
PEFT folder under --lora-roots: files validated, copied into the artifact store, placed and pushed to the
simulated engines); 100,000 loads that way would take an hour or more (docs/performance.md#control-plane),
and the rest are SEEDED WITH SQL straight into `adapters` and `adapter_versions` (one row each, active,
replicas {1, 3}, a version recorded without artifact-store files, as versions from before the store are).
Their first placement is SEEDED WITH SQL too by default (--place-seeded sql: one `placements` row each,
desired loaded on its first engine in rendezvous order, observed absent, so the first pass's engine rounds
load them all): the control plane's own first pass over 100,000 new adapters would take most of the run
(--place-seeded control-plane measures it). From there on every placement change is the control plane's.

Reconcile passes: the control plane's own timer is set out of the way (LORAPLANE_RECONCILE_INTERVAL_S=3600)
and the bench runs each pass with `POST /v1/engines/reconcile`, which runs exactly what the timer runs
(Reconciler.reconcile_all: the fleet pass, then every healthy engine's round), so two passes never overlap
and each is timed from its request to its answer. The target is a steady pass (nothing to change) within
the default reconcile interval (ControlPlaneSettings.reconcile_interval_s).

Phases, in order:
1. initial placement: passes until every adapter is held observed loaded (and no more loads or unloads
   than rebalancing's bound);
2. steady passes (--steady-passes), timed, with the control plane's CPU seconds over each;
3. routes: `GET /v1/routes` (router token) once in full (size in bytes), then --revalidations requests
   with `If-None-Match` (304 expected), p50/p99;
4. heartbeats only, for --beat-window-s: control-plane CPU (/proc/<pid>/stat) per accepted heartbeat;
5. leave: the first --leave engines stop answering and beating; after `engine_stale_after_s` passes run
   until their adapters are held elsewhere and their placements released; the adapters whose set of
   engines changed, against the 1/N target (N = engines), and those among them that held none of the
   leaving engines (rebalancing moves, at most `rebalance_max_moves` a pass);
6. return: those engines restart (empty), register and beat again; --return-passes passes, with the
   placements changed in each (bounded by `rebalance_max_moves` a pass, plus the registrations' own passes).
All along (but in phase 4) a client pages through `GET /v1/lora_adapters` (limit 100, random offsets), one
request at a time: its latency p50/p99 during the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx

# bench/stack.py: run as `python bench/fleet_scale.py`
from stack import REPO, cpu_seconds, free_port, process

# this folder is first on sys.path, and bench/control_plane.py would shadow the package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
from control_plane.settings import ControlPlaneSettings  # noqa: E402

BASE_MODEL = "sim-base"  # bench/engine_sim.py's
HOLDING = ("loaded", "pinned")
# --profile: the control plane's main thread under cProfile from one SIGUSR1 to the next (the steady passes)
PROFILED = """
import cProfile, signal, sys
from shared.cli import run
path, profile, on = sys.argv[1], cProfile.Profile(), []
def toggle(*_):
    if on:
        profile.disable(); profile.dump_stats(path); on.clear()
    else:
        profile.enable(); on.append(1)
signal.signal(signal.SIGUSR1, toggle)
sys.exit(run(sys.argv[2:]))
"""
DEFAULTS = ControlPlaneSettings(admin_tokens=("unused",))  # the defaults the targets refer to


def log(message: str) -> None:
    print(f"[fleet_scale {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def ms(values: list[float]) -> dict:
    return {"p50_ms": round(1e3 * pct(values, 50), 2), "p99_ms": round(1e3 * pct(values, 99), 2),
            "max_ms": round(1e3 * max(values), 2), "requests": len(values)}


# ---- database -----------------------------------------------------------------------------------
@contextlib.contextmanager
def fresh_database(server: str) -> Iterator[str]:
    """A new database on `server` (postgresql://user@host:port), dropped on exit; yields its URL."""
    name = f"fleet_scale_{os.getpid()}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(f"{server}/postgres")
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    try:
        yield f"{server}/{name}"
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


async def seed_adapters(url: str, count: int, start: int) -> float:
    """`count` adapters seed-<n> (n from `start`) with one active version each, replicas {1, 3}: set-based
    SQL, seconds taken."""
    started = time.perf_counter()
    conn = await asyncpg.connect(url)
    try:
        async with conn.transaction():
            await conn.execute("""
                INSERT INTO adapters (name, base_model, description, labels, created_at, updated_at,
                                      min_replicas, max_replicas)
                SELECT 'seed-' || lpad(g::text, 6, '0'), $1, '', '{}'::jsonb, now(), now(), 1, 3
                FROM generate_series($2::int, $3::int) g""", BASE_MODEL, start, start + count - 1)
            await conn.execute("""
                INSERT INTO adapter_versions (adapter_id, number, uri, sha256, rank, alpha, target_modules,
                                              size_bytes, created_at)
                SELECT id, 1, '/seeded/' || name, encode(sha256(convert_to(name, 'UTF8')), 'hex'), 8, 16,
                       '["q_proj", "v_proj"]'::jsonb, 1048576, now()
                FROM adapters WHERE active_version_id IS NULL AND name LIKE 'seed-%'""")
            await conn.execute("""
                UPDATE adapters a SET active_version_id = v.id FROM adapter_versions v
                WHERE v.adapter_id = a.id AND a.active_version_id IS NULL AND a.name LIKE 'seed-%'""")
    finally:
        await conn.close()
    return time.perf_counter() - started


async def placement_state(url: str) -> tuple[dict[int, frozenset[int]], int, dict[str, int]]:
    """(adapter id -> engines desired holding it, placements desired held and observed loaded, engine ids)."""
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("""
            SELECT v.adapter_id, p.engine_id, p.observed FROM placements p
            JOIN adapter_versions v ON v.id = p.adapter_version_id WHERE p.desired = ANY($1::text[])""",
                                list(HOLDING))
        engines = {r["name"]: r["id"] for r in await conn.fetch("SELECT id, name FROM engines")}
    finally:
        await conn.close()
    held: dict[int, set[int]] = {}
    for r in rows:
        held.setdefault(r["adapter_id"], set()).add(r["engine_id"])
    return {a: frozenset(e) for a, e in held.items()}, sum(r["observed"] == "loaded" for r in rows), engines


async def unserved(url: str) -> int:
    """Adapters with an active version that no placement desired held and observed loaded serves."""
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetchval("""
            SELECT count(*) FROM adapters a WHERE a.active_version_id IS NOT NULL AND NOT EXISTS (
                SELECT 1 FROM placements p WHERE p.adapter_version_id = a.active_version_id
                AND p.desired = ANY($1::text[]) AND p.observed = 'loaded')""", list(HOLDING))
    finally:
        await conn.close()


async def seed_placements(url: str) -> float:
    """Each seeded adapter desired loaded (observed absent: the engines load it on the next pass) on its
    first engine in rendezvous order with equal weights, where the control plane's own first pass over
    empty engines would put it (rendezvous.rank; the pass then weighs by free room as engines fill, so its
    choice differs for some). Seconds taken."""
    from control_plane.domain.placements.rendezvous import unit_hash

    started = time.perf_counter()
    conn = await asyncpg.connect(url)
    try:
        engines = [r["name"] for r in await conn.fetch("SELECT name FROM engines ORDER BY id")]
        ids = {r["name"]: r["id"] for r in await conn.fetch("SELECT id, name FROM engines")}
        versions = await conn.fetch("SELECT name, active_version_id FROM adapters WHERE name LIKE 'seed-%'")
        now = dt.datetime.now(dt.UTC)
        rows = [(ids[max(engines, key=lambda e, a=v["name"]: unit_hash(a, e))], v["active_version_id"], "loaded",
                 "absent", now, now) for v in versions]
        await conn.copy_records_to_table("placements", records=rows, columns=[
            "engine_id", "adapter_version_id", "desired", "observed", "created_at", "updated_at"])
    finally:
        await conn.close()
    return time.perf_counter() - started


def changed(before: dict[int, frozenset[int]], after: dict[int, frozenset[int]]) -> list[int]:
    return [a for a in before.keys() | after.keys() if before.get(a) != after.get(a)]


# ---- processes ----------------------------------------------------------------------------------
class Simulator:
    """bench/engine_sim.py as a child process, driven by lines on its stdin."""

    def __init__(self, cp: str, env: dict[str, str], engines: int, heartbeat_s: float, log_path: Path) -> None:
        self.log = log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "engine_sim.py"), "--control-plane", cp, "--engines", str(engines),
             "--heartbeat-s", str(heartbeat_s)], cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True)
        first = self._line()
        if "registered" not in first:
            raise SystemExit(f"the simulator did not register its engines: {first}")

    def _line(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the simulator exited; see {self.log.name}")
        return json.loads(line)

    def command(self, line: str) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._line()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class AdminLister(threading.Thread):
    """Pages through GET /v1/lora_adapters one request at a time while `running` is set."""

    def __init__(self, cp: str, token: str, adapters: int) -> None:
        super().__init__(daemon=True)
        self.http = httpx.Client(base_url=cp, headers={"Authorization": f"Bearer {token}"}, timeout=120)
        self.adapters = adapters
        self.running = threading.Event()
        self.stopped = threading.Event()
        self.seconds: list[float] = []
        self.errors = 0

    def run(self) -> None:
        rng = random.Random(0)
        while not self.stopped.is_set():
            if not self.running.wait(timeout=0.5):
                continue
            offset = rng.randrange(0, max(self.adapters - 100, 1))
            started = time.perf_counter()
            try:
                ok = self.http.get("/v1/lora_adapters", params={"limit": 100, "offset": offset}).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                self.seconds.append(time.perf_counter() - started)
            else:
                self.errors += 1
            time.sleep(0.2)


# ---- phases -------------------------------------------------------------------------------------
def run_pass(admin: httpx.Client, cp_pid: int) -> dict:
    """One full reconcile pass through the API: wall seconds, control-plane CPU seconds, what it did."""
    cpu, started = cpu_seconds(cp_pid), time.perf_counter()
    r = admin.post("/v1/engines/reconcile")
    seconds = time.perf_counter() - started
    if r.status_code != 200:
        raise SystemExit(f"POST /v1/engines/reconcile answered {r.status_code}: {r.text[:300]}")
    engines = r.json()["engines"]
    return {"seconds": round(seconds, 3), "cpu_s": round(cpu_seconds(cp_pid) - cpu, 2), "engines": len(engines),
            "skipped": sum(e["skipped"] for e in engines), "loaded": sum(len(e["loaded"]) for e in engines),
            "unloaded": sum(len(e["unloaded"]) for e in engines), "failed": sum(len(e["failed"]) for e in engines)}


def api_loads(admin: httpx.Client, root: Path, count: int) -> list[float]:
    """`count` adapters through POST /v1/load_lora_adapter (distinct PEFT folders); seconds of each."""
    from data_plane.demo.adapters import DemoAdapter, write_lora_adapter
    from data_plane.demo.model_builder import write_demo_model  # torch: only for writing the sample's files

    base = root / "base"
    write_demo_model(base, seed=0)
    spec = DemoAdapter(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    seconds = []
    for k in range(count):
        path = write_lora_adapter(base, root / "adapters" / f"api-{k:04d}", spec, seed=1000 + k)
        started = time.perf_counter()
        r = admin.post("/v1/load_lora_adapter", json={"lora_name": f"api-{k:04d}", "lora_path": str(path),
                                                      "base_model": BASE_MODEL, "replicas": {"min": 1, "max": 3}})
        seconds.append(time.perf_counter() - started)
        if r.status_code != 200:
            raise SystemExit(f"load of api-{k:04d} answered {r.status_code}: {r.text[:300]}")
    return seconds


def converge(admin: httpx.Client, cp_pid: int, db: str, what: str, max_passes: int = 30) -> list[dict]:
    """Passes until every adapter is held observed loaded and a pass loads or unloads no more than
    rebalancing's bound (rebalancing goes on, a bounded number of moves a pass: see the module doc)."""
    passes = []
    while True:
        p = run_pass(admin, cp_pid)
        p["unserved_after"] = asyncio.run(unserved(db))
        passes.append(p)
        log(f"{what}: pass {len(passes)}: {p}")
        if p["unserved_after"] == 0 and p["loaded"] + p["unloaded"] <= DEFAULTS.rebalance_max_moves:
            return passes
        if len(passes) >= max_passes:
            raise SystemExit(f"{what}: not converged after {max_passes} passes")


def routes_figures(cp: str, token: str, revalidations: int) -> dict:
    with httpx.Client(base_url=cp, headers={"Authorization": f"Bearer {token}"}, timeout=120) as router:
        started = time.perf_counter()
        full = router.get("/v1/routes")
        full_s = time.perf_counter() - started
        full.raise_for_status()
        etag = full.headers["etag"]
        seconds, not_modified = [], 0
        for _ in range(revalidations):
            started = time.perf_counter()
            r = router.get("/v1/routes", headers={"If-None-Match": etag})
            seconds.append(time.perf_counter() - started)
            not_modified += r.status_code == 304
            time.sleep(0.05)
    body = full.json()
    return {"bytes": len(full.content), "models": len(body["models"]), "engines": len(body["engines"]),
            "full_get_ms": round(1e3 * full_s, 1), "revalidate": ms(seconds) | {"answered_304": not_modified}}


def heartbeat_cpu(sim: Simulator, cp_pid: int, window_s: float) -> dict:
    before, cpu = sim.command("stats"), cpu_seconds(cp_pid)
    time.sleep(window_s)
    after, used = sim.command("stats"), cpu_seconds(cp_pid) - cpu
    beats = after["beats"] - before["beats"]
    return {"window_s": window_s, "beats": beats, "beats_per_s": round(beats / window_s, 1),
            "control_plane_cpu_s": round(used, 3),
            "cpu_ms_per_beat": round(1e3 * used / beats, 3) if beats else None,
            "beat_latency_ms_p50": after["beat_ms_p50"], "beat_latency_ms_max": after["beat_ms_max"],
            "beat_failures": after["beat_failures"] - before["beat_failures"]}


def main() -> int:
    defaults = DEFAULTS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=200)
    parser.add_argument("--adapters", type=int, default=100_000)
    parser.add_argument("--api-adapters", type=int, default=200, help="of --adapters, loaded through the API")
    parser.add_argument("--leave", type=int, default=10, help="engines that leave and come back")
    parser.add_argument("--heartbeat-s", type=float, default=3.0, help="as `loraplane engine --heartbeat-interval-s`")
    parser.add_argument("--stale-after-s", type=float, default=defaults.engine_stale_after_s)
    parser.add_argument("--steady-passes", type=int, default=3)
    parser.add_argument("--return-passes", type=int, default=3)
    parser.add_argument("--max-leave-passes", type=int, default=6)
    parser.add_argument("--revalidations", type=int, default=200)
    parser.add_argument("--beat-window-s", type=float, default=20.0)
    parser.add_argument("--place-seeded", choices=("sql", "control-plane"), default="sql",
                        help="who places the SQL-seeded adapters first: SQL rows in rendezvous order (fast), or "
                             "the control plane's first pass (100,000 take far longer than the rest of the run)")
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432")
    parser.add_argument("--profile", type=Path, help="run the control plane under cProfile, stats written here")
    args = parser.parse_args()
    api_count = min(args.api_adapters, args.adapters)
    admin_token, read_token, router_token, engine_admin = (secrets.token_urlsafe(16) for _ in range(4))
    out: dict = {"benchmark": "fleet_scale",
                 "machine": f"{os.cpu_count()} CPU cores shared by the control plane, PostgreSQL, the simulator "
                            "and the bench client",
                 "setup": {"engines": args.engines, "engines_simulated": True, "adapters": args.adapters,
                           "adapters_via_api": api_count, "adapters_seeded_by_sql": args.adapters - api_count,
                           "seeded_adapters_first_placed_by": args.place_seeded,
                           "replicas": {"min": 1, "max": 3}, "heartbeat_s": args.heartbeat_s,
                           "engine_stale_after_s": args.stale_after_s,
                           "default_reconcile_interval_s": defaults.reconcile_interval_s,
                           "rebalance_max_moves": defaults.rebalance_max_moves, "database": "PostgreSQL"}}
    with tempfile.TemporaryDirectory() as tmp_name, fresh_database(args.postgres) as db_url:
        tmp = Path(tmp_name)
        cp = f"http://127.0.0.1:{free_port()}"
        cp_env = {**os.environ, "LORAPLANE_ADMIN_TOKENS": admin_token, "LORAPLANE_READ_TOKENS": read_token,
                  "LORAPLANE_ROUTER_TOKENS": router_token, "LORAPLANE_ENGINE_ADMIN_TOKEN": engine_admin,
                  "LORAPLANE_DATABASE_URL": db_url, "LORAPLANE_ARTIFACT_STORE": (tmp / "artifacts").as_uri(),
                  "LORAPLANE_RECONCILE_INTERVAL_S": "3600",  # the bench runs the passes (see the module doc)
                  "LORAPLANE_ENGINE_STALE_AFTER_S": str(args.stale_after_s), "LORAPLANE_LOG_LEVEL": "warning"}
        runner = ["-c", PROFILED, str(args.profile.resolve())] if args.profile else ["-m", "shared.cli"]
        cp_cmd = [sys.executable, *runner, "control", "--port", cp.rsplit(":", 1)[1], "--lora-roots", str(tmp)]
        with process(cp_cmd, cp_env, tmp / "control.log", cp) as cp_proc:
            sim_env = {**os.environ, "LORAPLANE_ADMIN_TOKEN": admin_token, "LORAPLANE_ENGINE_ADMIN_TOKEN": engine_admin}
            log(f"control plane up (pid {cp_proc.pid}); starting {args.engines} simulated engines")
            sim = Simulator(cp, sim_env, args.engines, args.heartbeat_s, tmp / "engine_sim.log")
            lister = AdminLister(cp, read_token, args.adapters)
            try:
                with httpx.Client(base_url=cp, headers={"Authorization": f"Bearer {admin_token}"},
                                  timeout=600) as admin:
                    phases(out, args, admin, sim, lister, cp, cp_proc.pid, db_url, router_token, api_count, tmp)
            except (Exception, SystemExit) as exc:  # what was measured so far is still printed
                out["incomplete"] = f"{type(exc).__name__}: {exc}"[:500]
            finally:
                lister.stopped.set()
                sim.stop()
    out["admin_list"] = (ms(lister.seconds) if lister.seconds else {}) | {"errors": lister.errors, "page": 100}
    print(json.dumps(out))
    return 0 if "incomplete" not in out else 1


def phases(out: dict, args: argparse.Namespace, admin: httpx.Client, sim: Simulator, lister: AdminLister, cp: str,
           cp_pid: int, db: str, router_token: str, api_count: int, tmp: Path) -> None:
    """The phases of the module doc, each one's figures put in `out` as soon as it ends."""
    log(f"{api_count} adapters through POST /v1/load_lora_adapter")
    api_seconds = api_loads(admin, tmp, api_count) if api_count else []
    seeded = args.adapters - api_count
    log(f"seeding {seeded} adapters with SQL")
    sql_s = asyncio.run(seed_adapters(db, seeded, 0)) if seeded else 0.0
    out["registration"] = {"api_load": ms(api_seconds) if api_seconds else None, "sql_seed_s": round(sql_s, 2)}
    if seeded and args.place_seeded == "sql":
        log("seeding their first placements with SQL")
        out["registration"]["sql_placements_s"] = round(asyncio.run(seed_placements(db)), 2)
    lister.start()
    lister.running.set()

    log("initial placement")
    initial = converge(admin, cp_pid, db, "initial placement")
    held, loaded, engine_ids = asyncio.run(placement_state(db))
    out["initial_placement"] = {"passes": initial, "seconds": round(sum(p["seconds"] for p in initial), 1),
                                "placements": sum(len(e) for e in held.values()), "observed_loaded": loaded}

    log("steady passes")
    if args.profile:
        os.kill(cp_pid, signal.SIGUSR1)
    sim.command("stats")  # heartbeat latencies from here on
    steady = [run_pass(admin, cp_pid) for _ in range(args.steady_passes)]
    beats = sim.command("stats")
    if args.profile:
        os.kill(cp_pid, signal.SIGUSR1)
        log(f"profile of the control plane's steady passes in {args.profile}")
    seconds = [p["seconds"] for p in steady]
    out["reconcile_pass"] = {
        "seconds": {"median": round(statistics.median(seconds), 2), "range": [min(seconds), max(seconds)]},
        "control_plane_cpu_s": statistics.median(p["cpu_s"] for p in steady), "passes": steady,
        "heartbeat_latency_during_passes_ms": {"p50": beats["beat_ms_p50"], "max": beats["beat_ms_max"]},
        "target_s": DEFAULTS.reconcile_interval_s,
        "meets_target": statistics.median(seconds) <= DEFAULTS.reconcile_interval_s}
    log(f"steady: {steady}")

    log("routes")
    out["routes"] = routes_figures(cp, router_token, args.revalidations)

    log("heartbeats only")
    lister.running.clear()
    time.sleep(1.0)
    out["heartbeats"] = heartbeat_cpu(sim, cp_pid, args.beat_window_s)
    lister.running.set()

    log(f"{args.leave} engines leave")
    before, _, _ = asyncio.run(placement_state(db))
    leaving_names = [f"sim-{i:03d}" for i in range(args.leave)]
    leaving = {engine_ids[n] for n in leaving_names}
    sim.command(f"down {args.leave}")
    left_at = time.monotonic()
    time.sleep(args.stale_after_s + 1.0)
    passes = converge(admin, cp_pid, db, "leave", args.max_leave_passes)
    replaced_s = time.monotonic() - left_at
    after, _, _ = asyncio.run(placement_state(db))
    moved = changed(before, after)
    on_leaving = [a for a in moved if before.get(a, frozenset()) & leaving]
    still_on_leaving = sum(bool(e & leaving) for e in after.values())
    out["leave"] = {"engines": args.leave, "passes": passes, "seconds_from_leaving_to_replaced": round(replaced_s, 1),
                    "adapters_moved": len(moved), "fraction_moved": round(len(moved) / max(len(before), 1), 4),
                    "target_fraction": round(args.leave / args.engines, 4),
                    "adapters_held_by_leaving_before": sum(bool(e & leaving) for e in before.values()),
                    "moved_not_from_leaving": len(moved) - len(on_leaving),
                    "adapters_still_on_leaving": still_on_leaving}

    log(f"{args.leave} engines come back")
    before = after
    sim.command("up")
    time.sleep(2.0)  # the registrations' own passes (each registration runs one, and reconciles that engine)
    after_kicks, _, _ = asyncio.run(placement_state(db))
    rounds = [{"after": "registrations", "adapters_changed": len(changed(before, after_kicks))}]
    previous = after_kicks
    for _ in range(args.return_passes):
        p = run_pass(admin, cp_pid)
        now, _, _ = asyncio.run(placement_state(db))
        rounds.append(p | {"adapters_changed": len(changed(previous, now))})
        previous = now
    returned = {engine_ids[n] for n in leaving_names}
    out["return"] = {"engines": args.leave, "rounds": rounds,
                     "adapters_changed_total": len(changed(before, previous)),
                     "fraction_changed": round(len(changed(before, previous)) / max(len(before), 1), 4),
                     "placements_on_returned": sum(bool(e & returned) for e in previous.values()),
                     "bound_per_pass": DEFAULTS.rebalance_max_moves}
    lister.running.clear()


if __name__ == "__main__":
    sys.exit(main())
