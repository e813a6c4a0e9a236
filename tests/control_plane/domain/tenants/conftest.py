"""The tenants tests run on both databases (tests/control_plane/conftest.py); tenants and api_keys are not
among the tables that conftest truncates between PostgreSQL tests, so they are emptied here."""

from __future__ import annotations

from collections.abc import Iterator

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from tests.control_plane.conftest import run_blocking


async def _empty(url: str) -> None:
    conn = await asyncpg.connect(make_url(url).set(drivername="postgresql").render_as_string(hide_password=False),
                                 timeout=5)
    try:
        present = {r["tablename"] for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname='public'")}
        if "tenants" in present:
            await conn.execute("TRUNCATE api_keys, tenants RESTART IDENTITY CASCADE")
    finally:
        await conn.close()


@pytest.fixture(autouse=True)
def empty_tenants(db_url: str) -> Iterator[None]:
    if db_url.startswith("postgresql"):
        run_blocking(_empty, db_url)
    yield
