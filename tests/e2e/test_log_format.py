"""One log format for the whole stack: `loraplane up --log-format json` starts the control plane, an
engine and the router, whose every stderr line (ours, uvicorn's, alembic's, httpx's) is one JSON object with time, level,
logger and message; the routine traffic — heartbeats every 3 s (sent and received), /metrics scrapes,
/health probes — is not logged at INFO, so an idle stack prints nothing."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx

from tests.e2e.test_control_plane_engines import _free_port
from tests.e2e.test_up import start_up, wait_until_up

ROUTINE = ("/heartbeat", "/metrics", "/health", "/v1/routes")


def test_up_logs_one_json_object_per_line_and_routine_traffic_at_debug(tmp_path: Path) -> None:
    cp_port, engine_port = _free_port(), _free_port()
    cp, engine = f"http://127.0.0.1:{cp_port}", f"http://127.0.0.1:{engine_port}"
    out, err = tmp_path / "up.out", tmp_path / "up.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        process = start_up(tmp_path, cp_port, engine_port, "--log-format", "json", stdout=stdout, stderr=stderr)
    try:
        wait_until_up(process, out, err, timeout_s=180)
        auth = {"Authorization": f"Bearer {(tmp_path / '.loraplane' / 'admin-token').read_text().strip()}"}
        # at least two heartbeats after the registration: the engine's last_heartbeat moves twice
        seen: set[str] = set()
        deadline = time.monotonic() + 30
        while len(seen) < 3:
            assert time.monotonic() < deadline, f"heartbeats seen: {seen}"
            seen |= {e["last_heartbeat"] for e in httpx.get(cp + "/v1/engines", headers=auth, timeout=10).json()["data"]}
            for url in (cp, engine):  # a Prometheus scrape and a probe of each process
                assert httpx.get(url + "/metrics", timeout=10).status_code == 200
                assert httpx.get(url + "/health", timeout=10).status_code == 200
            time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()

    lines = [json.loads(line) for line in err.read_text().splitlines()]  # every line is one JSON object
    for line in lines:
        assert {"time", "level", "logger", "message"} <= set(line) <= {"time", "level", "logger", "message",
                                                                        "exception"}, line
    loggers = {line["logger"] for line in lines}
    # both processes' libraries log through the one handler: uvicorn (both servers), alembic (the
    # control plane's migrations), httpx (the pushes of the demo adapters), and our own loggers
    assert {"uvicorn.error", "alembic.runtime.migration", "httpx"} <= loggers, loggers
    assert any(name.startswith(("loraplane", "data_plane", "control_plane")) for name in loggers), loggers
    # the control plane, the engine and the router
    assert sum(line["message"].startswith("Started server process") for line in lines) == 3
    assert not any(line["logger"] == "alembic.runtime.plugins" for line in lines)  # start-up chatter: DEBUG
    noisy = [line for line in lines if line["level"] != "DEBUG" and any(r in line["message"] for r in ROUTINE)]
    assert noisy == [], noisy
