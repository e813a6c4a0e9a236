"""Direct database access for assertions (what the API recorded), and broken adapter folders."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import uuid
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from control_plane.db.models import AdapterVersion, AuditEvent, Engine, Placement


async def fetch_all(url: str, model: type) -> list:
    engine = create_async_engine(url)
    try:
        async with async_sessionmaker(engine)() as session:
            return list((await session.scalars(select(model).order_by(model.id))).all())
    finally:
        await engine.dispose()


async def audit(url: str) -> list[tuple[str, str, str]]:
    return [(e.action, e.target, e.outcome) for e in await fetch_all(url, AuditEvent)]


async def versions(url: str) -> list[AdapterVersion]:
    return await fetch_all(url, AdapterVersion)


async def placements(url: str) -> list[Placement]:
    return await fetch_all(url, Placement)


# Nothing listens on port 1 of loopback: a push there is refused at once (the tests that need engines
# that answer start real ones: tests/control_plane/domain/adapters/test_push.py, tests/e2e/).
UNREACHABLE = "http://127.0.0.1:1"


async def add_engines(url: str, *specs: tuple[str, str, str]) -> None:
    """(name, base_model, state) rows, as engine registration writes them, at an address nobody answers."""
    engine = create_async_engine(url)
    now = dt.datetime.now(dt.UTC)
    try:
        async with async_sessionmaker(engine)() as session:
            session.add_all([Engine(name=n, url=UNREACHABLE, base_model=b, state=s, last_heartbeat=now)
                             for n, b, s in specs])
            await session.commit()
    finally:
        await engine.dispose()


def broken_copy(source: Path, root: Path, kind: str) -> Path:
    """A copy of a good adapter folder under `root`, broken in one way."""
    out = root / "broken" / f"{kind}-{uuid.uuid4().hex[:8]}"
    shutil.copytree(source, out)
    config_path, weights = out / "adapter_config.json", out / "adapter_model.safetensors"
    config = json.loads(config_path.read_text())
    if kind == "no-weights":
        weights.unlink()
    elif kind == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif kind == "garbage-header":
        weights.write_bytes(b"\xff" * 64)
    elif kind == "not-lora":
        config["peft_type"] = "IA3"
    elif kind == "dora":
        config["use_dora"] = True
    elif kind == "rank-mismatch":
        config["r"] = config["r"] * 2
    elif kind == "fewer-targets":
        config["target_modules"] = ["q_proj"]
    elif kind == "bad-json":
        config_path.write_text("{not json")
        return out
    config_path.write_text(json.dumps(config))
    return out
