"""serves_base_model: an adapter's base model matches an engine by its served name, its checkpoint's
`_name_or_path`, its model path (trailing slashes aside) or its config.json digest, on real rows in
SQLite and PostgreSQL (the clause uses rtrim, which both must understand alike)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from control_plane.db import migrate
from control_plane.db.models import Engine
from control_plane.domain.engines.matching import engine_serves, normalise, serves_base_model

DIGEST = "ab" * 32


@pytest.fixture
async def session(db_url: str) -> AsyncIterator[AsyncSession]:
    engine = create_async_engine(db_url)
    await migrate.upgrade(engine)
    async with async_sessionmaker(engine, expire_on_commit=False)() as s:
        s.add_all([
            Engine(name="full", url="http://127.0.0.1:1", base_model="llama", model_name_or_path="meta/llama-3/",
                   model_path="/models/llama-3/", config_digest=DIGEST),
            Engine(name="bare", url="http://127.0.0.1:2", base_model="llama"),  # served name only
            Engine(name="other", url="http://127.0.0.1:3", base_model="qwen", model_name_or_path="Qwen/Qwen2",
                   model_path="/models/qwen", config_digest="cd" * 32),
            Engine(name="demo", url="http://127.0.0.1:4", base_model="demo", model_name_or_path="demo",
                   model_path="/srv/lp/.demo/model/"),
        ])
        await s.commit()
        yield s
    await engine.dispose()


async def matching(session: AsyncSession, base: str) -> list[str]:
    rows = await session.scalars(select(Engine.name).where(serves_base_model(base)).order_by(Engine.name))
    return list(rows.all())


@pytest.mark.parametrize(("base", "expected"), [
    ("llama", ["bare", "full"]),  # the served name
    ("meta/llama-3", ["full"]),  # _name_or_path, stored with a trailing slash
    ("meta/llama-3//", ["full"]),
    ("/models/llama-3", ["full"]),  # the model path
    ("/models/llama-3/", ["full"]),
    (DIGEST, ["full"]),  # config.json's digest
    (f"sha256:{DIGEST}", ["full"]),
    (DIGEST.upper(), ["full"]),
    ("Qwen/Qwen2", ["other"]),
    ("/models/qwen/", ["other"]),
    ("meta/llama", []),  # a prefix is not a match
    ("/models", []),
    ("Llama", []),  # names are case-sensitive (hub ids and paths are)
    ("mistral", []),
    # a relative path that resolves to an engine's model path (from the folder it lies under)
    (".demo/model", ["demo"]),
    ("./.demo/model/", ["demo"]),
    ("lp/.demo/model", ["demo"]),
    ("models/llama-3", ["full"]),
    ("demo/model", []),  # `.demo` is not `demo`
    ("_demo/model", []),  # LIKE's wildcards are plain characters here
    ("%/model", []),
    ("../models/llama-3", []),  # `..` resolves nowhere definite
    ("model", []),  # one segment: a name, matched only whole
])
async def test_an_engine_matches_by_any_name_it_registered(session: AsyncSession, base: str,
                                                           expected: list[str]) -> None:
    assert await matching(session, base) == expected
    rows = (await session.scalars(select(Engine).order_by(Engine.name))).all()
    assert [e.name for e in rows if engine_serves(e, base)] == expected  # the in-memory form agrees


def test_normalise_strips_trailing_slashes_and_space_only() -> None:
    assert normalise(" /models/x// ") == "/models/x"
    assert normalise("/") == "/"
    assert normalise("org/model") == "org/model"
