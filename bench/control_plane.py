"""Control-plane figures: list latency over 10,000 adapters (SQLite and PostgreSQL), load fan-out to 4
real engines, and 200 concurrent admin calls. Prints one JSON object.

    .venv/bin/python bench/control_plane.py [--adapters 10000] [--engines 4] [--postgres-url postgresql://postgres@127.0.0.1:5432/test]

Real processes over loopback: `loraplane control` and `loraplane engine --enable-lora` on the demo model.
The 10,000 adapters are inserted straight into the database (registering each through the API would
validate 10,000 folders); everything measured goes through HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from sqlalchemy import insert, update
from sqlalchemy.ext.asyncio import create_async_engine
from stack import engine_admin_token  # bench/stack.py: run as `python bench/control_plane.py`
from tqdm import tqdm

from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model

REPO = Path(__file__).resolve().parents[1]
ADMIN, READ, ENGINE_TOKEN = (secrets.token_urlsafe(16) for _ in range(3))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, process: subprocess.Popen, what: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{what} exited with {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise SystemExit(f"{what} did not become healthy")


@contextlib.contextmanager
def _process(cmd: list[str], log: Path, env: dict[str, str], url: str, what: str) -> Iterator[str]:
    with log.open("w") as out:
        process = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_healthy(url, process, what)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def control_plane(tmp: Path, database_url: str, adapter_root: Path) -> contextlib.AbstractContextManager[str]:
    port = _free_port()
    env = {**os.environ, "LORAPLANE_ADMIN_TOKENS": ADMIN, "LORAPLANE_READ_TOKENS": READ,
           "LORAPLANE_ENGINE_TOKEN": ENGINE_TOKEN, "LORAPLANE_RECONCILE_INTERVAL_S": "3600"}
    cmd = [sys.executable, "-m", "shared.cli", "control", "--port", str(port), "--database-url", database_url,
           "--lora-roots", str(adapter_root), "--log-level", "warning"]
    return _process(cmd, tmp / f"control-{port}.log", env, f"http://127.0.0.1:{port}", "control plane")


def engine(tmp: Path, base: Path, root: Path, cp: str, name: str) -> contextlib.AbstractContextManager[str]:
    port = _free_port()
    env = {**os.environ, "LORAPLANE_CONTROL_PLANE_TOKEN": ADMIN}
    cmd = [sys.executable, "-m", "shared.cli", "engine", "--model", str(base), "--served-model-name", "demo",
           "--port", str(port), "--device", "cpu", "--enable-lora", "--lora-roots", str(root),
           "--admin-token", engine_admin_token(ENGINE_TOKEN, name), "--control-plane", cp, "--engine-name", name,
           "--num-kv-blocks", "64", "--max-model-len", "256", "--log-level", "warning"]
    return _process(cmd, tmp / f"{name}.log", env, f"http://127.0.0.1:{port}", f"engine {name}")


async def seed(database_url: str, count: int) -> None:
    """`count` adapters with one active version each, inserted in bulk."""
    from control_plane.db.models.adapter import Adapter
    from control_plane.db.models.adapter_version import AdapterVersion

    db = create_async_engine(database_url)
    async with db.begin() as conn:
        await conn.execute(insert(Adapter), [
            {"name": f"bench-{i:05d}", "base_model": "demo", "description": "", "labels": {"team": f"t{i % 10}"}}
            for i in range(count)
        ])
        ids = (await conn.execute(Adapter.__table__.select().with_only_columns(Adapter.id, Adapter.name))).all()
        await conn.execute(insert(AdapterVersion), [
            {"adapter_id": adapter_id, "number": 1, "uri": f"/adapters/{name}", "sha256": f"{adapter_id:064x}",
             "rank": 16, "alpha": 32.0, "target_modules": ["q_proj", "v_proj"], "size_bytes": 1 << 20}
            for adapter_id, name in ids
        ])
        versions = (await conn.execute(AdapterVersion.__table__.select().with_only_columns(
            AdapterVersion.id, AdapterVersion.adapter_id))).all()
        for version_id, adapter_id in versions:
            await conn.execute(update(Adapter).where(Adapter.id == adapter_id).values(active_version_id=version_id))
    await db.dispose()


def list_latency(cp: str, total: int, samples: int = 200) -> dict:
    times = []
    with httpx.Client(headers={"Authorization": f"Bearer {READ}"}, timeout=30) as client:
        for i in range(samples + 10):
            offset = (i * 7919) % max(1, total - 100)
            start = time.perf_counter()
            r = client.get(cp + "/v1/lora_adapters", params={"limit": 100, "offset": offset})
            elapsed = time.perf_counter() - start
            assert r.status_code == 200 and len(r.json()["data"]) == 100, r.text[:300]
            if i >= 10:  # the first requests warm connections and caches
                times.append(elapsed)
    q = statistics.quantiles(times, n=100)
    return {"page": 100, "adapters": total, "p50_ms": round(q[49] * 1e3, 2), "p99_ms": round(q[98] * 1e3, 2),
            "target_p99_ms": 50}


async def concurrent_admin(cp: str, paths: dict[str, Path], calls: int = 200) -> dict:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(headers=headers, timeout=120) as client:
        async def call(i: int) -> int:
            kind = i % 4
            if kind == 0:
                r = await client.post(cp + "/v1/load_lora_adapter", json={
                    "lora_name": "conc", "lora_path": str(paths["demo-short"]), "base_model": "demo"})
            elif kind == 1:
                r = await client.get(cp + "/v1/lora_adapters", params={"limit": 100})
            elif kind == 2:
                r = await client.get(cp + "/v1/lora_adapters/bench-00042")
            else:
                r = await client.post(cp + "/v1/lora_adapters/bench-00042/activate", json={"version": 1})
            return r.status_code
        codes = await asyncio.gather(*(call(i) for i in range(calls)))
    return {"calls": calls, "status_5xx": sum(c >= 500 for c in codes),
            "statuses": {str(c): codes.count(c) for c in sorted(set(codes))}, "target_5xx": 0}


def fan_out(cp: str, paths: dict[str, Path], engines: int, loads: int = 6) -> dict:
    times, outcomes = [], []
    with httpx.Client(headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120) as client:
        for i in range(loads):
            path = paths["demo-pirate" if i % 2 == 0 else "demo-poet"]  # new content each time: a real push
            start = time.perf_counter()
            r = client.post(cp + "/v1/load_lora_adapter", json={"lora_name": "fan", "lora_path": str(path),
                                                                   "base_model": "demo"})
            times.append(time.perf_counter() - start)
            outcomes.extend(e["outcome"] for e in r.json()["engines"])
    return {"engines": engines, "loads": loads, "p50_ms": round(statistics.median(times) * 1e3, 1),
            "max_ms": round(max(times) * 1e3, 1), "engine_outcomes": {o: outcomes.count(o) for o in set(outcomes)}}


async def _create_database(admin_url: str, name: str, drop: bool = False) -> None:
    import asyncpg

    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}"' if drop else f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


def main() -> int:
    # run as `python bench/control_plane.py`, this folder is first on sys.path and this file's name
    # would shadow the control_plane package
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=10_000)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--postgres-url", default="postgresql://postgres@127.0.0.1:5432/test")
    args = parser.parse_args()
    figures: dict = {"benchmark": "control_plane", "machine": "2 CPU cores, everything on loopback"}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        base = tmp / "demo"
        write_demo_model(base, seed=0)
        root = tmp / "adapters"
        paths = write_demo_adapters(base, root)
        steps = tqdm(total=3, desc="control-plane benchmark", file=sys.stderr)
        sqlite_url = f"sqlite+aiosqlite:///{tmp / 'control.db'}"
        with control_plane(tmp, sqlite_url, root) as cp:
            asyncio.run(seed(sqlite_url, args.adapters))
            figures["list_sqlite"] = list_latency(cp, args.adapters)
            steps.update()
            with contextlib.ExitStack() as stack:
                for n in range(args.engines):
                    stack.enter_context(engine(tmp, base, root, cp, f"e{n}"))
                figures["load_fan_out"] = fan_out(cp, paths, args.engines)
                figures["concurrent_admin_calls"] = asyncio.run(concurrent_admin(cp, paths))
            steps.update()
        database = f"lp_bench_{secrets.token_hex(4)}"
        admin_url = args.postgres_url
        try:
            asyncio.run(_create_database(admin_url, database))
        except Exception as exc:  # no PostgreSQL reachable: say so instead of failing the whole run
            figures["list_postgres"] = {"skipped": f"PostgreSQL not reachable at {admin_url}: {type(exc).__name__}"}
        else:
            pg_url = admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://") + f"/{database}"
            try:
                with control_plane(tmp, pg_url, root) as cp:
                    asyncio.run(seed(pg_url, args.adapters))
                    figures["list_postgres"] = list_latency(cp, args.adapters)
            finally:
                asyncio.run(_create_database(admin_url, database, drop=True))
        steps.update()
        steps.close()
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
