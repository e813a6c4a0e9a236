"""The `loraplane engine` server with its engine-core process (the default) and without it.

The other tests here that start real servers (test_openai_client, test_errors, test_lora_api,
test_hardening, test_disconnect, test_openapi, test_server_flags) run through the core process too,
since it is the default; the in-process tests (TestClient over make_engine) keep the engine thread.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx

from data_plane.adapters.loading.shared_tensors import file_prefix, shm_dir
from data_plane.demo.adapters import DemoAdapter, write_lora_adapter
from data_plane.lora.weights import TARGET_MODULES
from tests.data_plane.api.conftest import EngineServer

COMPLETIONS = "/v1/completions"


def children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(c) for c in (task / "children").read_text().split()}
    return found


def alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def core_of(server: EngineServer) -> int:
    """The engine-core child (an engine serving LoRA also has an adapter reader child)."""
    (core,) = [pid for pid in children(server.process.pid)
               if "data_plane.engine.core.process_main" in Path(f"/proc/{pid}/cmdline").read_text()]
    return core


def test_a_dead_core_fails_health_and_the_request_in_flight(start_engine):
    server = start_engine()
    core = core_of(server)
    body = {"model": "demo", "prompt": "Once", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", COMPLETIONS, json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it is running now
            os.kill(core, signal.SIGKILL)
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "engine_dead" and "engine-core process exited" in error["message"]
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["type"] == "engine_dead"
        # new requests are refused at once, not left waiting on a core that is gone
        refused = client.post(COMPLETIONS, json={"model": "demo", "prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "engine_dead"


def test_sigterm_stops_the_core_and_removes_the_adapters_files(start_engine, demo_model_dir, tmp_path):
    adapter = write_lora_adapter(demo_model_dir, tmp_path / "x", DemoAdapter(8, 16, TARGET_MODULES), seed=1)
    server = start_engine("--enable-lora", "--lora-modules", f"x={adapter}")
    core = core_of(server)
    ok = httpx.post(server.url + COMPLETIONS, json={"model": "x", "prompt": "Hi", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert list(shm_dir().glob(file_prefix(server.process.pid) + "*"))  # the adapter's host copy
    server.process.send_signal(signal.SIGTERM)
    # stopped, uvicorn raises the signal again: it ends the process through Python's exit, with the status a
    # shell gives a process the signal ended, so that finalizers run and remove the adapter's file
    assert server.process.wait(60) == 128 + signal.SIGTERM
    assert "Application shutdown complete" in server.log.read_text()
    assert "killing it" not in server.log.read_text()  # the core stopped when told, it was not killed
    assert not list(shm_dir().glob(file_prefix(server.process.pid) + "*"))
    for _ in range(100):  # the server reaped it before exiting; this only waits for /proc to catch up
        if not alive(core):
            break
        time.sleep(0.1)
    assert not alive(core)


def test_the_engine_thread_is_kept_with_no_engine_core_process(start_engine):
    server = start_engine("--no-engine-core-process")
    assert children(server.process.pid) == set()
    ok = httpx.post(server.url + COMPLETIONS, json={"model": "demo", "prompt": "Hi", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_a_number_the_wire_cannot_carry_is_a_400_and_the_engine_serves_on(start_engine):
    """msgpack holds 64-bit integers; a schema-valid request with a larger one (found by the contract run)
    is refused with a 400 naming the problem instead of a 500, and the core keeps serving."""
    server = start_engine()
    for body in ({"stop_token_ids": [2**70]}, {"stop_token_ids": [1, 2**65]}):
        r = httpx.post(server.url + COMPLETIONS, json={"model": "demo", "prompt": "Hi", "max_tokens": 3, **body},
                       timeout=60)
        assert r.status_code == 400, r.text
        assert "64 bits" in r.json()["error"]["message"]
    ok = httpx.post(server.url + COMPLETIONS, json={"model": "demo", "prompt": "Hi", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_adapter_files_of_an_engine_killed_outright_are_removed_when_the_next_one_starts(start_engine, demo_model_dir,
                                                                                          tmp_path):
    """An adapter's host copy is a shared-memory file its API process owns (data_plane/adapters/loading/shared_tensors.py);
    killed outright, that process removes nothing: the next engine to start does, and only that one's."""
    adapter = write_lora_adapter(demo_model_dir, tmp_path / "x", DemoAdapter(8, 16, TARGET_MODULES), seed=1)
    killed = start_engine("--enable-lora", "--lora-modules", f"x={adapter}")
    ok = httpx.post(killed.url + COMPLETIONS, json={"model": "x", "prompt": "Hi", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200  # handed to its core too
    (left,) = shm_dir().glob(file_prefix(killed.process.pid) + "*")
    live = shm_dir() / f"{file_prefix(os.getpid())}kept"
    live.write_bytes(b"x")
    try:
        killed.process.kill()
        killed.process.wait(30)
        assert left.exists()
        start_engine()
        assert not left.exists() and live.exists()
    finally:
        live.unlink(missing_ok=True)
