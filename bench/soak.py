"""Soak: N minutes of mixed traffic plus admin churn against a real control plane and engine; prints one
JSON object comparing the start and the end (target: every figure flat within 5 %).

    .venv/bin/python bench/soak.py [--minutes 2] [--concurrency 4] [--database-url postgresql+asyncpg://…]

Real processes over loopback (`loraplane control`, `loraplane engine --enable-lora --control-plane …` on
the demo model). Traffic: completions and chat completions, streamed and not, for the base model and
three adapters; admin churn: activations back and forth between two versions, unloads and re-loads,
listings and stats, about one call a second. Measured at the end of the warm-up (`start`) and at the
end (`end`): each process's resident memory and open file descriptors, the database's size, and the
p99 latency of the requests of the first and the last window of `--window-s` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
from stack import stack  # bench/stack.py: run as `python bench/soak.py`
from tqdm import tqdm

from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model

ADAPTERS = ("demo-pirate", "demo-poet", "demo-short")


def process_figures(pid: int) -> dict[str, int]:
    """Resident memory (bytes) and open file descriptors of a process, from /proc (Linux)."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
    return {"rss_bytes": rss_kb * 1024, "open_fds": len(os.listdir(f"/proc/{pid}/fd"))}


TABLES = ("adapters", "adapter_versions", "placements", "engines", "audit_events")


def database_figures(database_url: str) -> dict[str, object]:
    """Bytes the database uses (SQLite: pages in use, so that the write-ahead log's size, which swings
    with checkpoints, does not count; PostgreSQL: pg_database_size) and rows per table."""
    if database_url.startswith("sqlite"):
        import sqlite3

        path = Path(database_url.split("///", 1)[1])
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            used = conn.execute("PRAGMA page_count").fetchone()[0] - conn.execute("PRAGMA freelist_count").fetchone()[0]
            size = used * conn.execute("PRAGMA page_size").fetchone()[0]
            rows = {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES}
        finally:
            conn.close()
        return {"bytes": size, "rows": rows}
    import asyncpg
    from sqlalchemy.engine import make_url

    async def query() -> dict[str, object]:
        dsn = make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)
        conn = await asyncpg.connect(dsn)
        try:
            size = await conn.fetchval("SELECT pg_database_size(current_database())")
            rows = {t: await conn.fetchval(f"SELECT count(*) FROM {t}") for t in TABLES}
        finally:
            await conn.close()
        return {"bytes": size, "rows": rows}

    return asyncio.run(query())


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Soak:
    def __init__(self, cp: str, engine: str, folders: dict[str, dict[str, Path]], admin_token: str) -> None:
        self.cp = cp
        self.admin_token = admin_token
        self.engine = engine
        self.folders = folders  # version key ("v1"/"v2") -> adapter -> folder
        self.latencies: list[tuple[float, float]] = []  # (finished at, seconds)
        self.statuses: dict[str, int] = {}
        self.admin_statuses: dict[str, int] = {}
        self.stop = asyncio.Event()
        self.running = asyncio.Event()  # cleared while figures are sampled: the processes are idle then
        self.running.set()
        self.in_flight = 0
        self.started = 0.0

    def _count(self, table: dict[str, int], key: object) -> None:
        table[str(key)] = table.get(str(key), 0) + 1

    async def traffic(self, worker: int) -> None:
        rng = random.Random(worker)
        async with httpx.AsyncClient(base_url=self.engine, timeout=60) as client:
            while not self.stop.is_set():
                await self.running.wait()
                model = rng.choice(["demo", *ADAPTERS])
                stream = rng.random() < 0.3
                if rng.random() < 0.5:
                    path = "/v1/completions"
                    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": rng.randint(4, 16)}
                else:
                    path = "/v1/chat/completions"
                    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a story"}],
                            "max_tokens": rng.randint(4, 16)}
                body |= {"temperature": rng.choice([0, 0.8]), "stream": stream}
                started = time.monotonic()
                self.in_flight += 1
                try:
                    async with client.stream("POST", path, json=body) as r:
                        async for _ in r.aiter_bytes():
                            pass
                    self._count(self.statuses, r.status_code)
                    if r.status_code == 200:
                        self.latencies.append((time.monotonic(), time.monotonic() - started))
                except httpx.HTTPError as exc:
                    self._count(self.statuses, type(exc).__name__)
                finally:
                    self.in_flight -= 1

    async def churn(self) -> None:
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        rng = random.Random(0)
        active = dict.fromkeys(ADAPTERS, 1)
        async with httpx.AsyncClient(base_url=self.cp, headers=headers, timeout=60) as client:
            while not self.stop.is_set():
                await self.running.wait()
                self.in_flight += 1
                try:
                    self._count(self.admin_statuses, await self._admin_call(client, rng, active))
                except httpx.HTTPError as exc:
                    self._count(self.admin_statuses, type(exc).__name__)
                finally:
                    self.in_flight -= 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), 1.0)

    async def _admin_call(self, client: httpx.AsyncClient, rng: random.Random, active: dict[str, int]) -> str:
        name = rng.choice(ADAPTERS)
        action = rng.choice(["activate", "activate", "reload", "list", "stats"])
        if action == "activate":
            active[name] = 3 - active[name]
            r = await client.post(f"/v1/lora_adapters/{name}/activate", json={"version": active[name]})
        elif action == "reload":
            await client.post("/v1/unload_lora_adapter", json={"lora_name": name})
            r = await client.post("/v1/load_lora_adapter", json={
                "lora_name": name, "lora_path": str(self.folders[f"v{active[name]}"][name]), "base_model": "demo"})
        elif action == "list":
            r = await client.get("/v1/lora_adapters")
        else:
            r = await client.get("/v1/lora_stats")
        return f"{action} {r.status_code}"

    async def run(self, seconds: float, concurrency: int, on_tick, warmup_s: float, sample) -> dict:  # noqa: ANN001
        """Traffic for `seconds`; `sample()` (blocking) once after `warmup_s` and once at the end, each time
        with the traffic paused and nothing in flight. Returns {"start": …, "end": …}."""
        tasks = [asyncio.create_task(self.traffic(i)) for i in range(concurrency)]
        tasks.append(asyncio.create_task(self.churn()))
        samples: dict[str, dict] = {}
        self.started = started = time.monotonic()
        while (elapsed := time.monotonic() - started) < seconds:
            await asyncio.sleep(min(1.0, seconds - elapsed))
            on_tick(time.monotonic() - started)
            if "start" not in samples and time.monotonic() - started >= warmup_s:
                samples["start"] = await self._paused(sample)
        samples["end"] = await self._paused(sample)
        self.stop.set()
        self.running.set()
        await asyncio.gather(*tasks)
        return samples

    async def _paused(self, sample) -> dict:  # noqa: ANN001
        self.running.clear()
        while self.in_flight:
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # connections the servers close after their answers are gone
        try:
            return await asyncio.to_thread(sample)
        finally:
            self.running.set()

    def latency_ms(self, start: float, end: float, q: float) -> float | None:
        value = quantile([s for t, s in self.latencies if start <= t < end], q)
        return None if value is None else round(value * 1000, 1)


def change(start: float | None, end: float | None) -> float | None:
    if not start or end is None:
        return None
    return round(100 * (end - start) / start, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=4, help="traffic workers")
    parser.add_argument("--warmup-s", type=float, default=15.0, help="traffic before the start figures")
    parser.add_argument("--window-s", type=float, default=20.0, help="p99 over the first and last window")
    parser.add_argument("--database-url", help="default: SQLite in a temporary folder")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        base = tmp / "demo"
        write_demo_model(base, seed=0)
        folders = {f"v{seed + 1}": write_demo_adapters(base, tmp / "adapters" / f"s{seed}", seed=seed)
                   for seed in (0, 1)}
        database_url = args.database_url or f"sqlite+aiosqlite:///{tmp / 'control.db'}"
        with stack(tmp, base, tmp / "adapters", database_url) as running:
            cp, engine, cp_proc, engine_proc = running.cp, running.engine, running.cp_proc, running.engine_proc
            admin = running.admin()
            for version in ("v2", "v1"):  # two versions of each adapter, v1 active
                for name in ADAPTERS:
                    r = admin.post("/v1/load_lora_adapter", json={
                        "lora_name": name, "lora_path": str(folders[version][name]), "base_model": "demo"})
                    r.raise_for_status()
            for name in ADAPTERS:
                admin.post(f"/v1/lora_adapters/{name}/activate", json={"version": 1}).raise_for_status()

            soak = Soak(cp, engine, folders, running.admin_token)
            total_s = args.minutes * 60
            bar = tqdm(total=int(total_s), desc="soak", unit="s", file=sys.stderr)

            def sample() -> dict:
                return {"control_plane": process_figures(cp_proc.pid), "engine": process_figures(engine_proc.pid),
                        "database": database_figures(database_url)}

            def on_tick(elapsed: float) -> None:
                bar.n = int(elapsed)
                bar.refresh()

            samples = asyncio.run(soak.run(total_s, args.concurrency, on_tick, args.warmup_s, sample))
            bar.close()
            admin.close()
        start, end = samples["start"], samples["end"]
        figures: dict = {"benchmark": "soak", "minutes": args.minutes, "concurrency": args.concurrency,
                         "database_kind": "sqlite" if database_url.startswith("sqlite") else "postgresql",
                         "requests": soak.statuses, "admin_calls": soak.admin_statuses}
        for proc in ("control_plane", "engine"):
            figures[proc] = {key: {"start": start[proc][key], "end": end[proc][key],
                                   "change_pct": change(start[proc][key], end[proc][key])}
                             for key in ("rss_bytes", "open_fds")}
        figures["database"] = {"bytes": {"start": start["database"]["bytes"], "end": end["database"]["bytes"],
                                         "change_pct": change(start["database"]["bytes"], end["database"]["bytes"])},
                               "rows": {"start": start["database"]["rows"], "end": end["database"]["rows"]}}
        begin, finish = soak.started + args.warmup_s, soak.started + total_s
        for q in (0.5, 0.99):
            at_start = soak.latency_ms(begin, begin + args.window_s, q)
            at_end = soak.latency_ms(finish - args.window_s, finish + 1, q)
            figures[f"p{round(q * 100)}_ms"] = {"start": at_start, "end": at_end, "change_pct": change(at_start, at_end)}
        p99_end = figures["p99_ms"]["end"]
        # open descriptors are a small count (sockets come and go): ±2 is noise, a leak grows with the calls
        flat = {f"{p}.{k}": abs(figures[p][k]["end"] - figures[p][k]["start"])
                <= max(0.05 * figures[p][k]["start"], 2 if k == "open_fds" else 0)
                for p in ("control_plane", "engine") for k in ("rss_bytes", "open_fds")}
        flat["database.bytes"] = abs(figures["database"]["bytes"]["change_pct"] or 0) <= 5
        flat["p99_ms"] = p99_end is not None and abs(figures["p99_ms"]["change_pct"] or 0) <= 5
        figures["flat_within_5pct"] = flat
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
