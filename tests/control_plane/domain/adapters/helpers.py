"""Direct database access for assertions (what the API recorded), and broken adapter folders."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import struct
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


HUGE = "9" * 5000  # an integer Python's json refuses with a plain ValueError (over 4300 digits)
DEEP = "[" * 100_000 + "]" * 100_000  # nesting Python's json refuses with a RecursionError


def _split(weights: Path) -> tuple[dict, bytes]:
    raw = weights.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(weights: Path, header_text: str, data: bytes) -> None:
    raw = header_text.encode()
    weights.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _take_out(header: dict, data: bytes, begin: int, count: int) -> bytes:
    """The data without its `count` bytes at `begin`; the spans past them moved back by as many."""
    for key, info in header.items():
        if key != "__metadata__" and info["data_offsets"][0] > begin:
            info["data_offsets"] = [o - count for o in info["data_offsets"]]
    return data[:begin] + data[begin + count:]


def bad_spans(weights: Path, kind: str) -> str:
    """Rewrite a safetensors file so that every tensor still lies inside it but the spans are wrong:
    `overlap`, a tensor's data is the same bytes as another's of its shape (its own bytes are gone);
    `short-span`, the first tensor has 4 bytes fewer than its shape needs. The tensor made wrong."""
    header, data = _split(weights)
    order = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    if kind == "overlap":
        first = {}
        for key in order:
            info = header[key]
            twin = first.setdefault((info["dtype"], tuple(info["shape"])), key)
            if twin != key:
                begin, end = info["data_offsets"]
                data = _take_out(header, data, begin, end - begin)
                info["data_offsets"] = list(header[twin]["data_offsets"])
                break
        else:
            raise AssertionError("no two tensors of one shape")
    else:
        key = order[0]
        end = header[key]["data_offsets"][1]
        data = _take_out(header, data, end - 4, 4)
        header[key]["data_offsets"][1] = end - 4
    _write(weights, json.dumps(header), data)
    return key


def fresh_copy(source: Path, root: Path, label: str) -> Path:
    """A copy of an adapter folder under `root`, in a folder of its own."""
    out = root / "broken" / f"{label}-{uuid.uuid4().hex[:8]}"
    shutil.copytree(source, out)
    return out


def broken_copy(source: Path, root: Path, kind: str) -> Path:
    """A copy of a good adapter folder under `root`, broken in one way."""
    out = fresh_copy(source, root, kind)
    config_path, weights = out / "adapter_config.json", out / "adapter_model.safetensors"
    config = json.loads(config_path.read_text())
    if kind in ("overlap", "short-span"):
        bad_spans(weights, kind)
    elif kind in ("header-huge-integer", "header-deep-nesting"):
        header, data = _split(weights)
        value = HUGE if kind == "header-huge-integer" else DEEP
        _write(weights, json.dumps(header)[:-1] + f', "x": {{"dtype": "F32", "shape": [{value}]}}}}', data)
    elif kind in ("config-huge-integer", "config-deep-nesting"):
        value = HUGE if kind == "config-huge-integer" else DEEP
        config_path.write_text(json.dumps(config)[:-1] + f', "x": {value}}}')
        return out
    elif kind == "no-weights":
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
