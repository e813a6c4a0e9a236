"""An interval's engine rounds run at most `reconcile_concurrency` at once: each holds a database connection
while it calls its engine, and at 200 engines all at once they took the whole pool, so heartbeats waited past
the stale-after and healthy engines were taken for stale (bench/fleet_scale.py found it)."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx

from control_plane.app import create_app
from control_plane.domain.placements.reconcile import EngineRound
from tests.control_plane.conftest import admin

UNREACHABLE = "http://127.0.0.1:9"  # discard port: nothing listens, each call fails at once


async def test_rounds_run_at_most_reconcile_concurrency_at_once(settings) -> None:
    app = create_app(dataclasses.replace(settings, reconcile_concurrency=2))
    transport = httpx.ASGITransport(app=app)
    async with app.lifespan(), httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        names = [f"engine-{i}" for i in range(6)]
        for name in names:
            body = {"name": name, "url": UNREACHABLE, "base_model": "demo", "slots_total": 4}
            assert (await client.post("/v1/engines/register", json=body, headers=admin())).status_code == 200
        reconciler = app.state.reconciler
        await asyncio.gather(*reconciler._kicks)  # the rounds each registration started, not the interval's
        calls, running, most = [], 0, 0
        engine_round = reconciler.reconcile_engine

        async def counted(name: str) -> EngineRound:
            nonlocal running, most
            running += 1
            most = max(most, running)
            calls.append(name)
            try:
                await asyncio.sleep(0.05)  # long enough for every round let in to overlap
                return await engine_round(name)
            finally:
                running -= 1

        reconciler.reconcile_engine = counted
        rounds = await reconciler.reconcile_all()
        assert sorted(r.engine for r in rounds) == names
        assert sorted(calls) == names and most == 2
