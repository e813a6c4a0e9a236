"""One fleet pass (control_plane/domain/placements/fleet.py), in process, at fleet scale. Prints one JSON object.

    .venv/bin/python bench/fleet_pass.py [--engines 200] [--adapters 20000] [--passes 3] [--leave N] [--profile N]

A fresh PostgreSQL database (as bench/fleet_scale.py makes it, dropped at the end) gets --engines healthy
engine rows and --adapters adapters seeded with SQL (fleet_scale's seed_adapters and seed_placements), every
placement observed loaded; then --passes steady passes of FleetPass.run, each in its own transaction,
timed. No engine is called: this is the pass alone (what the control plane decides every reconcile
interval), without the engine rounds that bench/fleet_scale.py measures against simulated engines.
--leave N: after the steady passes, the first N engines go stale (their heartbeat two days old) and two
more passes are timed: the re-placement (every adapter they held gets a placement elsewhere: the adds),
then, once those are observed loaded (one UPDATE, as the engine rounds would record it), the release of
the stale engines' placements. That is the pass bench/fleet_scale.py's leave phase runs first.
--profile N prints the N costliest functions of the last pass (cProfile, cumulative) on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import asyncpg
from fleet_scale import (  # run as bench/fleet_pass.py
    BASE_MODEL,
    fresh_database,
    seed_adapters,
    seed_placements,
)
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from control_plane.db import migrate
from control_plane.domain.placements.fleet import FleetPass
from control_plane.settings import ControlPlaneSettings


async def seed(url: str, engines: int, adapters: int) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("""
            INSERT INTO engines (name, url, base_model, state, last_heartbeat, slots_total, slots_used,
                                 max_lora_rank, max_cpu_loras, created_at, updated_at)
            SELECT 'sim-' || lpad(g::text, 4, '0'), 'http://127.0.0.1:9/' || g, $1, 'healthy',
                   now() + interval '1 day', 8, 0, 64, 2000, now(), now()
            FROM generate_series(1, $2::int) g""", BASE_MODEL, engines)
    finally:
        await conn.close()
    await seed_adapters(url, adapters, 1)
    await seed_placements(url)
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("UPDATE placements SET observed = 'loaded'")
        await conn.execute("ANALYZE")
    finally:
        await conn.close()


async def timed_pass(sessions: async_sessionmaker, fleet: FleetPass, profile: cProfile.Profile | None) -> dict:
    async with sessions() as session:
        started = time.perf_counter()
        if profile:
            profile.enable()
        async with session.begin():
            report = await fleet.run(session)
        if profile:
            profile.disable()
        return {"seconds": round(time.perf_counter() - started, 3), "added": len(report.added),
                "released": len(report.released), "moves": len(report.moves)}


async def leave(url: str, engines: int) -> None:
    """The first `engines` engines stale: their last heartbeat two days ago (stale after one)."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("UPDATE engines SET last_heartbeat = now() - interval '2 days' "
                           "WHERE id IN (SELECT id FROM engines ORDER BY id LIMIT $1)", engines)
    finally:
        await conn.close()


async def observe_loaded(url: str) -> None:
    """What the engine rounds would record: every placement desired held is observed loaded."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("UPDATE placements SET observed = 'loaded' "
                           "WHERE desired IN ('loaded', 'pinned') AND observed <> 'loaded'")
    finally:
        await conn.close()


async def passes(url: str, args: argparse.Namespace) -> tuple[list[dict], dict | None]:
    database = create_async_engine(url.replace("postgresql://", "postgresql+asyncpg://"))
    await migrate.upgrade(database)
    print(f"[fleet_pass] seeding {args.engines} engines and {args.adapters} adapters", file=sys.stderr)
    await seed(url, args.engines, args.adapters)
    settings = ControlPlaneSettings(database_url=str(database.url), engine_stale_after_s=86400)
    fleet = FleetPass(settings)
    sessions = async_sessionmaker(database, expire_on_commit=False)
    out = []
    profile = cProfile.Profile() if args.profile else None
    for i in range(args.passes):
        out.append(await timed_pass(sessions, fleet, profile if i == args.passes - 1 and not args.leave else None))
        print(f"[fleet_pass] pass {i + 1}: {out[-1]}", file=sys.stderr)
    left = None
    if args.leave:
        await leave(url, args.leave)
        add = await timed_pass(sessions, fleet, profile)
        print(f"[fleet_pass] after {args.leave} engines left: {add}", file=sys.stderr)
        await observe_loaded(url)
        release = await timed_pass(sessions, fleet, None)
        print(f"[fleet_pass] once the new placements are loaded: {release}", file=sys.stderr)
        left = {"engines": args.leave, "replace": add, "release": release}
    if profile:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(args.profile)
        print(text.getvalue(), file=sys.stderr)
    await database.dispose()
    return out, left


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=200)
    parser.add_argument("--adapters", type=int, default=20_000)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--leave", type=int, default=0, help="engines that go stale after the steady passes")
    parser.add_argument("--profile", type=int, default=0, help="profile the last pass (the re-placement with --leave)")
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432")
    args = parser.parse_args()
    with fresh_database(args.postgres) as url:
        done, left = asyncio.run(passes(url, args))
    seconds = [p["seconds"] for p in done]
    out = {"benchmark": "fleet_pass", "engines": args.engines, "adapters": args.adapters,
           "passes": done, "median_s": statistics.median(seconds) if seconds else None,
           "range_s": [min(seconds), max(seconds)] if seconds else None}
    if left is not None:
        out["leave"] = left
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
