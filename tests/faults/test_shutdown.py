"""Graceful shutdown: SIGTERM to an engine or a control-plane replica finishes what is in flight.

Engine (data_plane/api/shutdown.py): admission closes at once (new requests 503 `shutting_down`, /health
503), the control plane is told (`drain`: no new placements there), in-flight requests run to their end
within --shutdown-timeout-s. Control plane: uvicorn's graceful shutdown lets an admin call that is
waiting on an engine's push answer before the process exits. The gate itself is also tested in process.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
import uvicorn

from data_plane.api.shutdown import AdmissionGate, DrainingServer
from tests.faults.conftest import Scenario
from tests.faults.driver import complete
from tests.faults.invariants import acknowledged, background, checkpoint


def test_engine_sigterm_drains_then_stops(scenario: Scenario) -> None:
    s, f = scenario, scenario.fleet
    e3 = f.engines["e3"]
    s.faults.open("e3")  # the driver's requests to e3 get 503, then connection refused
    body = {"model": "alpha", "prompt": "Once", "max_tokens": 120, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with f.plain.stream("POST", e3.url + "/v1/completions", json=body) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        next(lines)
        e3.signal(signal.SIGTERM)
        f.wait_for(lambda: complete(f.plain, e3.url, "alpha").status_code == 503, "admission to close", 5)
        refused = complete(f.plain, e3.url, "beta")
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down", refused.text
        assert f.plain.get(e3.url + "/health").status_code == 503
        # drained at the control plane while it still runs: its draining heartbeat was sent at once
        f.wait_for(lambda: f.engine_rows()["e3"]["state"] == "draining", "e3 to read draining", 5)
        rest = [line for line in lines if line.startswith("data: ")]
    # the request admitted before the signal ran to its end after admission had closed
    assert rest[-1] == "data: [DONE]" and len(rest) > 10, rest[-3:]
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert e3.process is not None and e3.process.wait(timeout=30) is not None
    # stopped: it reads draining until its heartbeats are missed for LORAPLANE_ENGINE_STALE_AFTER_S, then
    # stale (how long the stream took on a busy machine decides which); either way no new placements
    assert f.engine_rows()["e3"]["state"] in ("draining", "stale")
    s.timeline.change("zeta", "s1/demo-short")
    r = f.load("zeta", s.folders["s1/demo-short"], cp=0)
    assert r.status_code == 200 and sorted(e["engine"] for e in r.json()["engines"]) == ["e1", "e2"], r.text
    acknowledged(s, "zeta", r, 1)
    e3.spawn()  # the next test waits for it




def test_control_plane_sigterm_answers_the_call_in_flight(scenario: Scenario) -> None:
    s, f = scenario, scenario.fleet
    cp0, e2 = f.cps[0], f.engines["e2"]
    s.faults.open("e2")
    e2.signal(signal.SIGSTOP)  # the push to e2 waits: the admin call is in flight for a while
    try:
        s.timeline.change("beta", "s1/demo-poet")
        thread, out = background(lambda: f.load("beta", s.folders["s1/demo-poet"], cp=0))
        time.sleep(0.5)
        cp0.signal(signal.SIGTERM)
        time.sleep(1.0)
        assert thread.is_alive() and cp0.alive, "the replica stopped before answering the call in flight"
    finally:
        e2.signal(signal.SIGCONT)
    thread.join(30)
    r = out[0]
    assert isinstance(r, httpx.Response) and r.status_code == 200, r
    assert {e["outcome"] for e in r.json()["engines"]} == {"loaded"}, r.text
    acknowledged(s, "beta", r, 2)
    assert cp0.process is not None and cp0.process.wait(timeout=30) is not None
    f.start_cp(0)
    f.wait_engine_up("e3")
    checkpoint(s, "replica 0 shut down and came back, and e3 restarted", time.monotonic())


async def test_gate_refuses_new_requests_and_waits_for_admitted_ones() -> None:
    release = asyncio.Event()

    async def app(scope: dict, receive, send) -> None:  # noqa: ANN001
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    gate = AdmissionGate(app)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/v1/completions"}
    admitted = asyncio.create_task(gate(scope, None, send))
    await asyncio.sleep(0)
    assert gate.in_flight == 1
    gate.close()
    await gate(scope, None, send)  # refused at once, without reaching the app
    assert sent[0]["status"] == 503 and json.loads(sent[1]["body"])["error"]["code"] == "shutting_down"
    assert await gate.wait_idle(0.05) is False  # the admitted one still runs: the timeout says so
    release.set()
    assert await gate.wait_idle(5) is True
    await admitted
    assert sent[2]["status"] == 200 and gate.in_flight == 0


@pytest.mark.parametrize("path", ["/v1/models", "/v1/lora_adapters", "/metrics", "/v1/unload_lora_adapter"])
async def test_gate_lets_other_paths_through_while_closed(path: str) -> None:
    reached: list[str] = []

    async def app(scope: dict, receive, send) -> None:  # noqa: ANN001
        reached.append(scope["path"])

    gate = AdmissionGate(app)
    gate.close()
    await gate({"type": "http", "path": path}, None, None)
    assert reached == [path]


def _server(gate: AdmissionGate, on_drain, timeout_s: float) -> DrainingServer:  # noqa: ANN001
    return DrainingServer(uvicorn.Config(gate, lifespan="off"), gate, shutdown_timeout_s=timeout_s,
                          on_drain=on_drain)


async def test_drain_tells_the_control_plane_and_stops_after_the_timeout() -> None:
    forever = asyncio.Event()

    async def app(scope: dict, receive, send) -> None:  # noqa: ANN001
        await forever.wait()  # a request that never finishes

    gate = AdmissionGate(app)
    admitted = asyncio.create_task(gate({"type": "http", "path": "/v1/chat/completions"}, None, None))
    await asyncio.sleep(0)
    told: list[bool] = []

    async def on_drain() -> None:
        told.append(gate.closed)  # admission is closed before the control plane hears of it
        raise OSError("control plane down")  # must not keep the engine from stopping

    server = _server(gate, on_drain, timeout_s=0.2)
    started = time.monotonic()
    await server.drain("SIGTERM")
    assert told == [True] and server.should_exit
    assert 0.15 < time.monotonic() - started < 2
    admitted.cancel()


async def test_first_signal_drains_a_second_exits_at_once() -> None:
    release = asyncio.Event()

    async def app(scope: dict, receive, send) -> None:  # noqa: ANN001
        await release.wait()

    gate = AdmissionGate(app)
    admitted = asyncio.create_task(gate({"type": "http", "path": "/v1/completions"}, None, None))
    await asyncio.sleep(0)
    server = _server(gate, None, timeout_s=30)
    server._loop, server.started = asyncio.get_running_loop(), True  # as startup() leaves them
    server.handle_exit(signal.SIGTERM, None)
    await asyncio.sleep(0.05)
    assert gate.closed and not server.should_exit  # draining: waits for the admitted request
    server.handle_exit(signal.SIGTERM, None)  # the second signal: exit without waiting
    assert server.should_exit
    release.set()
    await admitted
