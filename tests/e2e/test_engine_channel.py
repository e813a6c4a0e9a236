"""The engine ↔ control plane channel over loopback, with real processes.

- resolve path injection: an anonymous `model: "../lora_stats"` at an engine started with
  --control-plane makes no call to the control plane (not a GET /v1/lora_stats there with its token)
  and is no 500;
- an unknown name asked 50 times makes one resolve call within the negative-cache TTL;
- names with `/` are resolved quoted (`%2F`) and pulled;
- --no-resolve-adapters: the engine never asks;
- the engine's own token (LORAPLANE_CONTROL_PLANE_TOKEN) registers and heartbeats, but cannot load
  adapters or act for another engine; ControlPlaneClient.drain() and an unhealthy heartbeat take the
  engine out of placement.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from data_plane.control_client import ControlPlaneClient
from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model
from data_plane.engine.sequence import Request
from shared.errors import EngineDeadError
from tests.data_plane.api.conftest import SHARED_FLAGS, EngineServer, run_engine
from tests.data_plane.api.engines import greedy, kill_loop_on_next_step, make_engine
from tests.e2e.test_control_plane_engines import (
    ADMIN,
    CP_TOKENS,
    READ,
    control_plane,
    engine_auth,
    engine_token,
    wait_for,
)

RESOLVE_ROUTE = "/v1/resolve/{name}"  # route labels of the control plane's metrics


def cp_requests(cp: str) -> dict[tuple[str, str], float]:
    """(route, status) -> count, from the control plane's own /metrics."""
    counts: dict[tuple[str, str], float] = {}
    for line in httpx.get(cp + "/metrics", timeout=10).text.splitlines():
        m = re.match(r'loraplane_control_requests_total\{(.*)\} (\S+)', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            key = (labels["route"], labels["status"])
            counts[key] = counts.get(key, 0.0) + float(m.group(2))
    return counts


def calls_to(cp: str, route: str) -> float:
    return sum(n for (r, _), n in cp_requests(cp).items() if r == route)


def other_calls(cp: str) -> float:
    """Calls to anything but register, heartbeat, resolve and /metrics."""
    mine = {"/v1/engines/register", "/v1/engines/{name}", RESOLVE_ROUTE, "/metrics", "/health"}  # {name}: heartbeats
    return sum(n for (r, _), n in cp_requests(cp).items() if r not in mine)


def complete(engine: EngineServer, model: str) -> httpx.Response:
    return httpx.post(engine.api + "/completions", timeout=60,
                      json={"model": model, "prompt": "hi", "max_tokens": 2, "temperature": 0})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    tmp = tmp_path_factory.mktemp("channel")
    base = tmp / "models" / "demo"
    write_demo_model(base, seed=0)
    root = tmp / "adapters"
    paths = write_demo_adapters(base, root)
    with contextlib.ExitStack() as stack, pytest.MonkeyPatch.context() as env:
        cp = stack.enter_context(control_plane(tmp, root))
        flags = ("--enable-lora", "--lora-roots", str(root), "--control-plane", cp, *SHARED_FLAGS)
        env.setenv("LORAPLANE_ADMIN_TOKEN", engine_token("e1"))
        env.setenv("LORAPLANE_CONTROL_PLANE_TOKEN", CP_TOKENS["e1"])
        e1 = stack.enter_context(run_engine(base, tmp / "e1.log", *flags, "--engine-name", "e1"))
        env.setenv("LORAPLANE_ADMIN_TOKEN", engine_token("e2"))
        env.setenv("LORAPLANE_CONTROL_PLANE_TOKEN", CP_TOKENS["e2"])
        e2 = stack.enter_context(run_engine(base, tmp / "e2.log", *flags, "--engine-name", "e2",
                                            "--no-resolve-adapters"))
        reader = httpx.Client(headers={"Authorization": f"Bearer {READ}"}, timeout=30)
        wait_for(lambda: {e["name"]: e["state"] for e in reader.get(cp + "/v1/engines").json()["data"]}
                 == {"e1": "healthy", "e2": "healthy"}, "both engines to register with their engine tokens")
        yield SimpleNamespace(cp=cp, e1=e1, e2=e2, paths=paths, reader=reader, base=base,
                              admin=httpx.Client(headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60))


def test_a_path_in_model_never_reaches_other_control_plane_routes(stack: SimpleNamespace) -> None:
    before_resolve, before_other = calls_to(stack.cp, RESOLVE_ROUTE), other_calls(stack.cp)
    for model in ("../lora_stats", "../../v1/engines/e2/drain", "a/../../lora_adapters", "x\n", "/etc/passwd"):
        r = complete(stack.e1, model)
        assert r.status_code in (400, 404), (model, r.status_code, r.text)
    assert calls_to(stack.cp, RESOLVE_ROUTE) == before_resolve  # refused before any call
    assert other_calls(stack.cp) == before_other
    assert {e["name"]: e["state"] for e in stack.reader.get(stack.cp + "/v1/engines").json()["data"]}["e2"] == "healthy"


def test_unknown_names_are_asked_once_within_the_ttl(stack: SimpleNamespace) -> None:
    before = calls_to(stack.cp, RESOLVE_ROUTE)
    with ThreadPoolExecutor(max_workers=10) as pool:
        statuses = list(pool.map(lambda _: complete(stack.e1, "nobody-has-this").status_code, range(50)))
    assert statuses == [404] * 50
    assert calls_to(stack.cp, RESOLVE_ROUTE) - before == 1


def test_names_with_a_slash_are_resolved_quoted_and_pulled(stack: SimpleNamespace) -> None:
    r = stack.admin.post(stack.cp + "/v1/load_lora_adapter", json={
        "lora_name": "org/poet", "lora_path": str(stack.paths["demo-poet"]), "base_model": "demo", "engines": []})
    assert r.status_code == 200, r.text
    assert complete(stack.e1, "org/poet").status_code == 200
    assert cp_requests(stack.cp).get((RESOLVE_ROUTE, "200"), 0) >= 1
    placed = stack.reader.get(stack.cp + "/v1/lora_adapters/org/poet").json()["placements"]
    assert [(p["engine"], p["desired"]) for p in placed] == [("e1", "loaded")]  # recorded with e1's own token
    # the engine started with --no-resolve-adapters never asks
    before = calls_to(stack.cp, RESOLVE_ROUTE)
    assert complete(stack.e2, "org/poet").status_code == 404
    assert calls_to(stack.cp, RESOLVE_ROUTE) == before


def test_a_pull_serves_the_recorded_bytes_whatever_became_of_the_folder(stack: SimpleNamespace) -> None:
    """The pull fetches the version from the control plane's artifact store by digest, so a folder edited
    (or removed) since the version was recorded is never served under it (engines never read
    lora_path)."""
    folder = stack.paths["demo-short"].parent / "edited-short"
    shutil.copytree(stack.paths["demo-short"], folder)
    r = stack.admin.post(stack.cp + "/v1/load_lora_adapter", json={
        "lora_name": "edited-short", "lora_path": str(folder), "base_model": "demo", "engines": []})
    assert r.status_code == 200, r.text
    recorded = r.json()["sha256"]
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 4096}))
    served = complete(stack.e1, "edited-short")
    assert served.status_code == 200, served.text
    listed = httpx.get(stack.e1.url + "/v1/lora_adapters", timeout=30,
                       headers=engine_auth("e1")).json()["adapters"]
    assert {a["name"]: a["sha256"] for a in listed}["edited-short"] == recorded


def test_an_engine_token_is_only_good_for_its_own_bookkeeping(stack: SimpleNamespace) -> None:
    as_e1 = {"Authorization": f"Bearer {CP_TOKENS['e1']}"}
    r = httpx.post(stack.cp + "/v1/load_lora_adapter", headers=as_e1, timeout=30, json={
        "lora_name": "x", "lora_path": str(stack.paths["demo-short"]), "base_model": "demo"})
    assert r.status_code == 403
    r = httpx.post(stack.cp + "/v1/engines/register", headers=as_e1, timeout=30,
                   json={"name": "e2", "url": "http://127.0.0.1:1", "base_model": "demo"})
    assert r.status_code == 403
    assert httpx.get(stack.cp + "/v1/engines", headers=as_e1, timeout=30).status_code == 403


def test_drain_and_unhealthy_heartbeats_take_an_engine_out_of_placement(
    stack: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ControlPlaneClient as the engine's heartbeat and shutdown use it, against the real control plane,
    speaking for e1 with e1's token and a real engine whose step loop died (in this process).
    Last in the module: e1 stays draining."""
    states = {}

    async def run() -> None:
        dead = make_engine(stack.base, enable_lora=True)
        dead.start()
        kill_loop_on_next_step(dead, monkeypatch, "step loop died")
        with pytest.raises(EngineDeadError):
            async for _ in dead.generate(Request("doomed", [1, 2, 3], greedy(2))):
                pass
        assert not dead.healthy
        client = ControlPlaneClient(stack.cp, CP_TOKENS["e1"], name="e1", engine_url=stack.e1.url,
                                    base_model="demo", slots_total=4, engine=dead, heartbeat_s=0.2)
        await client.start()
        try:
            for _ in range(100):
                await asyncio.sleep(0.1)
                listed = {e["name"]: e["state"] for e in stack.reader.get(stack.cp + "/v1/engines").json()["data"]}
                if listed["e1"] == "unhealthy":
                    break
            states["dead"] = listed["e1"]
            assert await client.drain() is True
            await asyncio.sleep(0.5)
            states["drained"] = {e["name"]: e["state"]
                                 for e in stack.reader.get(stack.cp + "/v1/engines").json()["data"]}["e1"]
        finally:
            await client.stop()
            await dead.shutdown()

    asyncio.run(run())
    assert states == {"dead": "unhealthy", "drained": "draining"}
    r = stack.admin.post(stack.cp + "/v1/load_lora_adapter", json={
        "lora_name": "after-drain", "lora_path": str(stack.paths["demo-short"]), "base_model": "demo"})
    assert r.status_code == 200 and [e["engine"] for e in r.json()["engines"]] == ["e2"], r.text


def test_resolve_is_bounded_against_a_misbehaving_control_plane(monkeypatch: pytest.MonkeyPatch) -> None:
    """ControlPlaneClient.resolve against loopback peers: unknown names cached for the TTL in a bounded
    cache, concurrent lookups of one name share one call, a reply of the wrong shape is no adapter."""
    import data_plane.control_client as control_client
    from tests.control_plane.domain.engines.peers import Reply, json_reply, serve

    monkeypatch.setattr(control_client, "NEGATIVE_CACHE_SIZE", 8)

    def answer(_method: str, path: str) -> Reply:
        if path.startswith("/v1/resolve/slow"):
            return Reply(404, b'{"error": {"message": "no"}}' + b" " * 20, drip_s=0.01)
        if path.startswith("/v1/resolve/shape"):
            return json_reply([1, 2, 3])
        if path.startswith("/v1/resolve/other"):
            return json_reply({"name": "someone-else", "version": 1, "uri": "/elsewhere", "sha256": "ab"})
        return Reply(404, b'{"error": {"message": "no"}}')

    async def run(url: str) -> None:
        client = ControlPlaneClient(url, "t", name="e1", engine_url="http://127.0.0.1:1", base_model="demo",
                                    slots_total=1, negative_ttl_s=0.5)
        await client.start()
        try:
            assert await asyncio.gather(*(client.resolve("slow") for _ in range(20))) == [None] * 20
            for name in [f"n{i}" for i in range(20)] + [f"n{i}" for i in range(12, 20)] + ["n0"]:
                assert await client.resolve(name) is None
            assert len(client._unknown) == 8  # bounded
            assert await client.resolve("shape") is None and await client.resolve("other") is None
            await asyncio.sleep(0.6)
            assert await client.resolve("n19") is None  # the TTL passed: asked again
        finally:
            await client.stop()

    with serve(answer) as peer:
        asyncio.run(run(peer.url))
        paths = [path.split("?")[0] for _, path, _ in peer.seen if path.startswith("/v1/resolve/")]
    assert paths.count("/v1/resolve/slow") == 1  # 20 concurrent lookups, one call
    # 20 names, then the last 8 again (cached), n0 again (fell out of the 8 entries), n19 after the TTL
    assert sum(paths.count(f"/v1/resolve/n{i}") for i in range(20)) == 20 + 0 + 1 + 1
