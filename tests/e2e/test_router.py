"""End to end over loopback: `loraplane control` (SQLite), three `loraplane engine`s registered with it and
`loraplane router` in front, each a process of its own, every credential in the environment.

Twelve adapters with one replica each are served through the router by their holder only (the engines'
own request counters say so) with the tokens of a direct request; streams equal the engine's chunk for chunk; an
adapter placed nowhere is placed by the router's request; unknown names are 404; the engines answer the
router's inference key only; a sustained load through the router on an adapter of replicas {1, 2} gives it a
second replica, and idleness takes it back; a killed holder's adapter is served again once the control
plane has placed it elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model
from tests.data_plane.api.conftest import SHARED_FLAGS, run_engine, scrape_metric
from tests.e2e.test_control_plane_engines import (
    ADMIN,
    CP_TOKENS,
    READ,
    _free_port,
    control_plane,
    engine_auth,
    engine_token,
    started,
)

openai = pytest.importorskip("openai")

ROUTER_TOKEN, ENGINE_KEY, CLIENT_KEY = "e2e-router-token", "e2e-engine-api-key", "e2e-client-key"
PROMPT = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
ENGINES = ("e1", "e2", "e3")
# 12 adapters of one replica: the demo folders under several names, 4 per engine's 4 slots
ONE_REPLICA = {"demo-pirate": "demo-pirate", "demo-poet": "demo-poet",
               **{f"{folder}-{i}": folder for i in (2, 3, 4) for folder in ("demo-pirate", "demo-poet", "demo-short")},
               "demo-short-5": "demo-short"}
ROUTED = 2  # requests per adapter through the router
BUSY_STREAMS = 12  # concurrent streams of one adapter: above the default 8 waiting + running per replica


def adapter_counts(engine_url: str, engine: str) -> dict[str, int]:
    """Engine `engine`'s finished requests per adapter (GET /v1/lora_stats, which needs its admin token)."""
    body = httpx.get(engine_url + "/v1/lora_stats", headers=engine_auth(engine), timeout=10).json()
    return {a["name"]: sum(a["requests"].values()) for a in body["adapters"]}


def holders(cp: str, model: str) -> set[str]:
    """The engines that hold `model` in the control plane's routing table (any residency)."""
    table = httpx.get(cp + "/v1/routes", headers={"Authorization": f"Bearer {READ}"}, timeout=10).json()
    route = next((m for m in table["models"] if m["model"] == model), None)
    return {h["engine"] for h in route["holders"]} if route else set()


def events(text: str) -> list[dict]:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: {"):
            event = json.loads(block.removeprefix("data: "))
            out.append({k: v for k, v in event.items() if k not in ("id", "created")})
    return out


@contextlib.contextmanager
def keep_running(url: str, body: dict, headers: dict) -> Iterator[None]:
    """Streams `body` to `url` one after another, in a thread, for as long as the block runs."""
    done = threading.Event()

    def run() -> None:
        while not done.is_set():
            with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
                for _ in response.iter_lines():
                    if done.is_set():
                        break

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=60)


def wait_for(predicate, what: str, timeout_s: float = 60) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_router_in_front_of_the_control_plane_and_three_engines(tmp_path: Path) -> None:
    base = tmp_path / "models" / "demo"
    write_demo_model(base, seed=0)
    root = tmp_path / "adapters"
    paths = write_demo_adapters(base, root)
    admin = httpx.Client(headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120)
    key = {"Authorization": f"Bearer {CLIENT_KEY}"}
    engine_key = {"Authorization": f"Bearer {ENGINE_KEY}"}
    with contextlib.ExitStack() as stack:
        cp = stack.enter_context(control_plane(
            tmp_path, root, LORAPLANE_ROUTER_TOKENS=ROUTER_TOKEN, LORAPLANE_ENGINE_STALE_AFTER_S="3",
            LORAPLANE_RECONCILE_INTERVAL_S="1", LORAPLANE_SCALE_WINDOW_S="2", LORAPLANE_SCALE_DOWN_IDLE_S="3"))
        engines = {}
        for name in ENGINES:
            engines[name] = stack.enter_context(run_engine(
                base, tmp_path / f"{name}.log", "--enable-lora", "--lora-roots", str(root), "--admin-token",
                engine_token(name), "--control-plane", cp, "--engine-name", name, *SHARED_FLAGS,
                # beats well inside the 3 s stale-after, or a busy machine reads them stale between two
                "--heartbeat-interval-s", "0.5",
                env={"LORAPLANE_CONTROL_PLANE_TOKEN": CP_TOKENS[name], "LORAPLANE_API_KEY": ENGINE_KEY}))
        port = _free_port()
        router = f"http://127.0.0.1:{port}"
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")}, "PYTHONUNBUFFERED": "1",
               "LORAPLANE_ROUTER_TOKEN": ROUTER_TOKEN, "LORAPLANE_ENGINE_API_KEY": ENGINE_KEY,
               "LORAPLANE_API_KEYS": CLIENT_KEY}
        stack.enter_context(started([sys.executable, "-m", "shared.cli", "router", "--control-plane", cp, "--port",
                                     str(port)], tmp_path / "router.log", env,
                                    lambda: httpx.get(router + "/health", timeout=2).json()["routing_table"]["engines"]
                                    == len(ENGINES), "router"))

        for name, folder in ONE_REPLICA.items():
            r = admin.post(cp + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(paths[folder]),
                                                               "base_model": "demo", "replicas": {"min": 1, "max": 1}})
            assert r.status_code == 200 and len(r.json()["engines"]) == 1, r.text
        r = admin.post(cp + "/v1/load_lora_adapter", json={"lora_name": "demo-short", "lora_path": str(
            paths["demo-short"]), "base_model": "demo", "replicas": {"min": 0, "max": 1}})
        assert r.status_code == 200 and r.json()["engines"] == [], r.text  # placed nowhere yet
        client = openai.OpenAI(base_url=router + "/v1", api_key=CLIENT_KEY, max_retries=0, timeout=60)
        wait_for(lambda: {m.id for m in client.models.list()} >= {"demo", "demo-short", *ONE_REPLICA},
                 "the router's table to list the adapters")

        # each one-replica adapter is served by its holder only, with the tokens of a direct request
        placed = {}
        for name in ONE_REPLICA:
            wait_for(lambda n=name: len(holders(cp, n)) == 1, f"{name} held by one engine")
            (placed[name],) = holders(cp, name)
        assert set(placed.values()) == set(ENGINES)  # spread over the fleet, not all on one engine
        before = {e: adapter_counts(s.url, e) for e, s in engines.items()}
        for name, holder in placed.items():
            direct = httpx.post(engines[holder].api + "/completions", json={"model": name, **PROMPT},
                                headers=engine_key, timeout=60).json()["choices"][0]["text"]
            for _ in range(ROUTED):
                r = httpx.post(router + "/v1/completions", json={"model": name, **PROMPT}, headers=key, timeout=60)
                assert r.status_code == 200 and r.headers["x-loraplane-engine"] == holder, r.text
                assert r.json()["choices"][0]["text"] == direct
        after = {e: adapter_counts(s.url, e) for e, s in engines.items()}
        for name, holder in placed.items():
            served = {e: after[e].get(name, 0) - before[e].get(name, 0) for e in engines}
            assert served == {e: 1 + ROUTED if e == holder else 0 for e in engines}, name
        # hits (device) and misses (host)
        assert scrape_metric(router, "loraplane_router_affinity_total") == ROUTED * len(ONE_REPLICA)

        # streaming through the router equals streaming from the engine, chunk for chunk
        stream = {"model": "demo-poet", **PROMPT, "stream": True}
        (holder,) = holders(cp, "demo-poet")
        direct = httpx.post(engines[holder].api + "/completions", json=stream, headers=engine_key, timeout=60)
        via = httpx.post(router + "/v1/completions", json=stream, headers=key, timeout=60)
        assert events(via.text) == events(direct.text) and len(events(via.text)) > 2
        chat = client.chat.completions.create(model="demo-pirate", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.choices[0].message.content is not None

        # while a request runs, the router reports its adapter's demand, and the control plane takes it
        # (one after another until a report is taken: a single one may end between two reports)
        long = {"model": "demo-poet", "prompt": "Once", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with keep_running(router + "/v1/completions", long, key):
            wait_for(lambda: scrape_metric(router, "loraplane_router_demand_reports_total", 'result="ok"') >= 1,
                     "an accepted demand report", timeout_s=30)
        assert scrape_metric(router, "loraplane_router_demand_reports_total", 'result="failed"') == 0

        # demand scaling on real traffic: BUSY_STREAMS streams through the router, each request counted once
        # (the router's in-flight count and the engine's queue are the same requests), keep above 8 per
        # replica for the 2 s window: a second engine takes the adapter; 3 s idle give the replica back
        r = admin.post(cp + "/v1/load_lora_adapter", json={"lora_name": "demo-busy", "lora_path": str(
            paths["demo-poet"]), "base_model": "demo", "replicas": {"min": 1, "max": 2}})
        assert r.status_code == 200 and len(r.json()["engines"]) == 1, r.text
        wait_for(lambda: len(holders(cp, "demo-busy")) == 1, "demo-busy held by one engine")
        # one request first: once answered, the router's table has a holder for it, so the streams below
        # are sent at once (none waits in the router for a placement, which its report would count too)
        r = httpx.post(router + "/v1/completions", json={"model": "demo-busy", **PROMPT}, headers=key, timeout=60)
        assert r.status_code == 200, r.text

        def busy() -> dict:
            return admin.get(cp + "/v1/lora_adapters/demo-busy").json()

        busy_stream = {"model": "demo-busy", "prompt": "Once", "max_tokens": 100, "ignore_eos": True, "stream": True}
        with contextlib.ExitStack() as streams:
            for _ in range(BUSY_STREAMS):
                streams.enter_context(keep_running(router + "/v1/completions", busy_stream, key))
            wait_for(lambda: busy()["replicas"]["target"] == 2 and len(holders(cp, "demo-busy")) == 2,
                     "a second replica of demo-busy under load")
        up = busy()["last_decision"]
        assert (up["from"], up["to"]) == (1, 2) and "above 8" in up["reason"], up
        assert 8 < up["figures"]["waiting"] + up["figures"]["running"] <= BUSY_STREAMS, up
        wait_for(lambda: busy()["replicas"]["target"] == 1 and len(holders(cp, "demo-busy")) == 1,
                 "demo-busy back to one replica once idle")
        down = busy()["last_decision"]
        assert (down["from"], down["to"]) == (2, 1) and "no requests" in down["reason"], down
        admin.post(cp + "/v1/unload_lora_adapter", json={"lora_name": "demo-busy"}).raise_for_status()

        # the adapter nobody held: the router's request places it, then it is served (a load's first
        # requests may have asked too, when the router's table had not yet listed it)
        placed_before = 0.0
        with contextlib.suppress(KeyError):  # no such sample before the first placement
            placed_before = scrape_metric(router, "loraplane_router_placements_total", 'outcome="placed"')
        r = httpx.post(router + "/v1/completions", json={"model": "demo-short", **PROMPT}, headers=key, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["x-loraplane-engine"] in engines
        assert scrape_metric(router, "loraplane_router_placements_total", 'outcome="placed"') == placed_before + 1
        # unknown names: 404 in the engines' shape; the keys: the client's at the router, the router's at engines
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
        assert httpx.post(router + "/v1/completions", json={"model": "demo", **PROMPT}).status_code == 401
        assert httpx.post(engines["e1"].api + "/completions", json={"model": "demo", **PROMPT}).status_code == 401

        # the holder of demo-pirate is killed: once the control plane has placed it elsewhere (stale after 3 s,
        # reconcile every 1 s), requests through the router succeed again
        (holder,) = holders(cp, "demo-pirate")
        engines[holder].process.send_signal(signal.SIGKILL)
        engines[holder].process.wait()
        others = set(engines) - {holder}

        def served_elsewhere() -> bool:
            r = httpx.post(router + "/v1/completions", json={"model": "demo-pirate", **PROMPT}, headers=key, timeout=60)
            return r.status_code == 200 and r.headers["x-loraplane-engine"] in others

        wait_for(served_elsewhere, "demo-pirate served by another engine", timeout_s=60)
        for _ in range(3):
            assert served_elsewhere()
        # and every other adapter the killed engine held, each by the one engine now holding it
        for name in (n for n, e in placed.items() if e == holder and n != "demo-pirate"):
            wait_for(lambda n=name: holders(cp, n) <= others and len(holders(cp, n)) == 1, f"{name} re-placed")
            (now,) = holders(cp, name)
            r = httpx.post(router + "/v1/completions", json={"model": name, **PROMPT}, headers=key, timeout=60)
            assert r.status_code == 200 and r.headers["x-loraplane-engine"] == now, r.text
