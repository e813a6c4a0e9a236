"""Pushing to real engines after a load / activate / unload commits, and recording what each answered."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import httpx
import pytest
from litestar.testing import AsyncTestClient

from control_plane.app import create_app
from tests.control_plane.conftest import _dsn, admin, reader
from tests.control_plane.domain.adapters.helpers import UNREACHABLE
from tests.control_plane.engines import (
    engine_adapters,
    engine_credentials,
    engine_pair,
    register_pair,
    served_control_plane,
)
from tests.data_plane.api.conftest import EngineServer
from tests.e2e.test_control_plane_engines import ENGINE_SECRET, engine_auth, engine_token
from tests.e2e.test_control_plane_engines import _free_port as free_port


@pytest.fixture(scope="module")
def cp_port() -> int:
    """Where each test serves its control plane (the engines fetch adapter versions from it)."""
    return free_port()


@pytest.fixture(scope="module")
def engines(demo: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, cp_port: int) -> Iterator[list[EngineServer]]:
    """Two real engines shared by this module's tests (each test uses adapter names of its own)."""
    with engine_pair(demo, tmp_path_factory.mktemp("push_engines"), f"http://127.0.0.1:{cp_port}") as pair:
        yield pair


@pytest.fixture
async def cp(settings, engines: list[EngineServer], cp_port: int) -> AsyncIterator[httpx.AsyncClient]:
    """The control plane with the engine token, over HTTP, both engines registered."""
    settings = dataclasses.replace(settings, engine_token_secret=ENGINE_SECRET, engine_credentials=engine_credentials())
    async with served_control_plane(settings, cp_port) as c:
        await register_pair(c, engines, admin())
        yield c


def unique(request: pytest.FixtureRequest, stem: str) -> str:
    return f"{stem}-{request.node.callspec.id}"


async def test_load_activate_unload_reach_the_adapters_engines(
        cp: httpx.AsyncClient, engines: list[EngineServer], demo: dict, request: pytest.FixtureRequest) -> None:
    name = unique(request, "push")
    r = await cp.post("/v1/load_lora_adapter", headers=admin(),
                      json={"lora_name": name, "lora_path": str(demo["demo-pirate"]), "base_model": "demo",
                            "replicas": {"min": 2}})
    assert r.status_code == 200, r.text
    assert [(e["engine"], e["outcome"], e["error"]) for e in r.json()["engines"]] == [
        ("ea", "loaded", None), ("eb", "loaded", None)]
    v1_sha = r.json()["sha256"]
    for server, engine in zip(engines, ("ea", "eb"), strict=True):
        assert engine_adapters(server, engine)[name]["sha256"] == v1_sha

    r = await cp.post("/v1/load_lora_adapter", headers=admin(), json={
        "lora_name": name, "lora_path": str(demo["demo-poet"]), "base_model": "demo", "pinned": True})
    assert r.status_code == 200 and r.json()["version"] == 2, r.text  # replaced in place on the engines
    v2_sha = r.json()["sha256"]
    for server, engine in zip(engines, ("ea", "eb"), strict=True):
        held = engine_adapters(server, engine)[name]
        assert (held["sha256"], held["pinned"]) == (v2_sha, True)

    r = await cp.post(f"/v1/lora_adapters/{name}/activate", json={"version": 1}, headers=admin())
    assert r.status_code == 200, r.text
    assert [e["outcome"] for e in r.json()["engines"]] == ["loaded", "loaded"]
    assert {(p["engine"], p["version"], p["desired"], p["observed"]) for p in r.json()["placements"]} == {
        ("ea", 1, "pinned", "loaded"), ("eb", 1, "pinned", "loaded"),
        ("ea", 2, "absent", "absent"), ("eb", 2, "absent", "absent")}
    for server, engine in zip(engines, ("ea", "eb"), strict=True):
        assert engine_adapters(server, engine)[name]["sha256"] == v1_sha

    r = await cp.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers=admin())
    assert r.status_code == 200, r.text
    assert [(e["engine"], e["outcome"]) for e in r.json()["engines"]] == [("ea", "unloaded"), ("eb", "unloaded")]
    for server, engine in zip(engines, ("ea", "eb"), strict=True):
        assert name not in engine_adapters(server, engine)
    detail = (await cp.get(f"/v1/lora_adapters/{name}", headers=reader())).json()
    assert {p["observed"] for p in detail["placements"]} == {"absent"}


async def test_partial_failure_is_207_and_total_failure_502(cp: httpx.AsyncClient, engines: list[EngineServer],
                                                           demo: dict, request: pytest.FixtureRequest) -> None:
    name = unique(request, "partial")
    body = {"name": "down", "url": UNREACHABLE, "base_model": "demo"}
    assert (await cp.post("/v1/engines/register", json=body, headers=admin())).status_code == 200
    r = await cp.post("/v1/load_lora_adapter", headers=admin(),
                      json={"lora_name": name, "lora_path": str(demo["demo-short"]), "base_model": "demo",
                            "replicas": {"min": 3, "max": "all"}})
    assert r.status_code == 207, r.text
    outcomes = {e["engine"]: e for e in r.json()["engines"]}
    assert {n: e["outcome"] for n, e in outcomes.items()} == {"down": "failed", "ea": "loaded", "eb": "loaded"}
    assert "ConnectError" in outcomes["down"]["error"]
    detail = (await cp.get(f"/v1/lora_adapters/{name}", headers=reader())).json()
    failed = [p for p in detail["placements"] if p["observed"] == "failed"]
    assert [(p["engine"], p["desired"]) for p in failed] == [("down", "loaded")] and failed[0]["last_error"]
    r = await cp.post("/v1/load_lora_adapter", headers=admin(), json={
        "lora_name": name, "lora_path": str(demo["demo-short"]), "base_model": "demo", "engines": ["down"]})
    assert r.status_code == 502 and r.json()["engines"][0]["outcome"] == "failed"
    r = await cp.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers=admin())
    assert r.status_code == 207  # ea and eb unload; down stays failed


async def test_an_engine_refusal_is_reported_not_retried(settings, engines: list[EngineServer], demo: dict,
                                                         request: pytest.FixtureRequest) -> None:
    name = unique(request, "refused")
    async with AsyncTestClient(app=create_app(dataclasses.replace(settings, engine_token_secret="wrong-secret"))) as c:
        body = {"name": "ea", "url": engines[0].url, "base_model": "demo"}
        await c.post("/v1/engines/register", json=body, headers=admin())
        r = await c.post("/v1/load_lora_adapter", headers=admin(),
                         json={"lora_name": name, "lora_path": str(demo["demo-short"]), "base_model": "demo"})
    assert r.status_code == 502
    [outcome] = r.json()["engines"]
    assert outcome["outcome"] == "failed" and "403" in outcome["error"] and "wrong-secret" not in r.text
    assert engine_token("ea", "wrong-secret") not in r.text
    assert name not in engine_adapters(engines[0], "ea")


async def test_reconcile_restores_what_an_engine_lost_and_removes_what_it_should_not_hold(
        cp: httpx.AsyncClient, engines: list[EngineServer], demo: dict, request: pytest.FixtureRequest) -> None:
    keep, drop = unique(request, "keep"), unique(request, "drop")
    for name, path in ((keep, demo["demo-pirate"]), (drop, demo["demo-short"])):
        r = await cp.post("/v1/load_lora_adapter", headers=admin(),
                          json={"lora_name": name, "lora_path": str(path), "base_model": "demo",
                                "replicas": {"min": 2}})
        assert r.status_code == 200, r.text
    # engine a loses `keep` (as after a restart); engine b missed the unload of `drop` (it was down)
    httpx.post(engines[0].api + "/unload_lora_adapter", json={"lora_name": keep}, headers=engine_auth("ea"),
               timeout=30)
    r = await cp.post("/v1/unload_lora_adapter", json={"lora_name": drop}, headers=admin())
    assert r.status_code == 200
    httpx.post(engines[1].api + "/load_lora_adapter", headers=engine_auth("eb"), timeout=30,
               json={"lora_name": drop, "lora_path": str(demo["demo-short"])})
    assert keep not in engine_adapters(engines[0], "ea") and drop in engine_adapters(engines[1], "eb")

    r = await cp.post("/v1/engines/reconcile", headers=admin())
    assert r.status_code == 200, r.text
    report = {e["engine"]: e for e in r.json()["engines"]}
    assert report["ea"]["loaded"] == [keep] and report["eb"]["unloaded"] == [drop]
    assert not report["ea"]["failed"] and not report["eb"]["failed"]
    assert keep in engine_adapters(engines[0], "ea") and drop not in engine_adapters(engines[1], "eb")
    again = (await cp.post("/v1/engines/reconcile", headers=admin())).json()["engines"]
    assert all(not (e["loaded"] or e["unloaded"] or e["failed"]) for e in again)  # converged
    assert (await cp.post("/v1/engines/reconcile", headers=reader())).status_code == 403


async def test_an_engine_locked_by_another_replica_is_skipped(cp: httpx.AsyncClient, settings) -> None:
    if settings.is_sqlite:
        pytest.skip("row locks: PostgreSQL only (SQLite runs a single replica)")
    conn = await asyncpg.connect(_dsn(settings.database_url), timeout=5)
    try:
        async with conn.transaction():  # another replica, in the middle of reconciling ea
            await conn.execute("SELECT id FROM engines WHERE name = 'ea' FOR UPDATE")
            report = (await cp.post("/v1/engines/reconcile", headers=admin())).json()["engines"]
            assert {e["engine"]: e["skipped"] for e in report} == {"ea": True, "eb": False}
    finally:
        await conn.close()
    report = (await cp.post("/v1/engines/reconcile", headers=admin())).json()["engines"]
    assert {e["engine"]: e["skipped"] for e in report} == {"ea": False, "eb": False}


async def test_lora_stats_combine_the_engines(cp: httpx.AsyncClient, engines: list[EngineServer], demo: dict,
                                              request: pytest.FixtureRequest) -> None:
    name = unique(request, "stats")
    r = await cp.post("/v1/load_lora_adapter", headers=admin(),
                      json={"lora_name": name, "lora_path": str(demo["demo-poet"]), "base_model": "demo",
                            "replicas": {"min": 2}})
    assert r.status_code == 200, r.text
    for server, n in ((engines[0], 2), (engines[1], 1)):
        for _ in range(n):
            r2 = httpx.post(server.api + "/completions", timeout=60,
                            json={"model": name, "prompt": "hi", "max_tokens": 3, "temperature": 0})
            assert r2.status_code == 200, r2.text
    r = await cp.get("/v1/lora_stats", headers=reader())
    assert r.status_code == 200, r.text
    [row] = [a for a in r.json()["adapters"] if a["name"] == name]
    assert sum(row["requests"].values()) == 3 and row["generated_tokens"] == 9
    assert row["ttft_seconds"]["samples"] == 3 and row["ttft_seconds"]["p50"] is not None
    assert row["e2e_seconds"]["p99"] >= row["e2e_seconds"]["p50"] > 0
    per_engine = {e["engine"]: e for e in row["engines"]}
    assert {n: sum(e["requests"].values()) for n, e in per_engine.items()} == {"ea": 2, "eb": 1}
    assert all(e["residency"] in ("device", "host", "disk") and e["age_s"] < 5 for e in per_engine.values())
    assert [(e["engine"], e["error"]) for e in r.json()["engines"]] == [("ea", None), ("eb", None)]
    assert (await cp.get("/v1/lora_stats")).status_code == 401


async def test_files_edited_after_registration_do_not_change_the_version(
        cp: httpx.AsyncClient, engines: list[EngineServer], demo: dict, request: pytest.FixtureRequest) -> None:
    # edit v1's adapter_config.json (alpha 4096) after registering it, then activate v1 again: the engines
    # load the recorded bytes, fetched from the artifact store
    name = unique(request, "integrity")
    v1_dir = Path(shutil.copytree(demo["demo-short"], demo["root"] / "integrity" / name))
    r = await cp.post("/v1/load_lora_adapter", headers=admin(),
                      json={"lora_name": name, "lora_path": str(v1_dir), "base_model": "demo",
                            "replicas": {"min": 2}})
    assert r.status_code == 200, r.text
    v1_sha = r.json()["sha256"]
    r = await cp.post("/v1/load_lora_adapter", headers=admin(),
                      json={"lora_name": name, "lora_path": str(demo["demo-poet"]), "base_model": "demo"})
    assert r.status_code == 200 and r.json()["version"] == 2, r.text
    config = v1_dir / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "lora_alpha": 4096}))
    shutil.rmtree(v1_dir / "..", ignore_errors=True)  # even gone altogether: engines never read the folder
    r = await cp.post(f"/v1/lora_adapters/{name}/activate", json={"version": 1}, headers=admin())
    assert r.status_code == 200, r.text
    for server, engine in zip(engines, ("ea", "eb"), strict=True):
        assert engine_adapters(server, engine)[name]["sha256"] == v1_sha


async def test_a_corrupted_blob_is_refused_by_a_fresh_engine_and_recorded(
        cp: httpx.AsyncClient, settings, engines: list[EngineServer], demo: dict,
        request: pytest.FixtureRequest) -> None:
    """A blob damaged in the store is refused by an engine that has not cached it (the
    checksum error lands on the placement) and the engine keeps serving everything else."""
    name = unique(request, "corrupt")
    folder = Path(shutil.copytree(demo["demo-pirate"], demo["root"] / "corrupt" / name))
    weights = folder / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = b"\x00\x00\x80\x3f"  # other bytes than any engine has cached: a digest of its own
    weights.write_bytes(bytes(data))
    r = await cp.post("/v1/load_lora_adapter", headers=admin(), json={
        "lora_name": name, "lora_path": str(folder), "base_model": "demo", "engines": []})
    assert r.status_code == 200 and r.json()["engines"] == [], r.text
    blob = Path(urlsplit(settings.artifact_store).path) / "blobs" / hashlib.sha256(bytes(data)).hexdigest()
    damaged = bytearray(blob.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    blob.write_bytes(bytes(damaged))
    r = await cp.post("/v1/load_lora_adapter", headers=admin(), json={
        "lora_name": name, "lora_path": str(folder), "base_model": "demo", "engines": ["ea"]})
    assert r.status_code == 502, r.text
    [outcome] = r.json()["engines"]
    assert "checksum mismatch for adapter_model.safetensors" in outcome["error"], outcome
    [placement] = [p for p in (await cp.get(f"/v1/lora_adapters/{name}", headers=reader())).json()["placements"]
                   if p["engine"] == "ea"]
    assert placement["observed"] == "failed" and "checksum mismatch" in placement["last_error"]
    assert name not in engine_adapters(engines[0], "ea")
    served = httpx.post(engines[0].api + "/completions", timeout=60,
                        json={"model": "demo", "prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert served.status_code == 200, served.text
