"""`loraplane up` (control_plane.up): control plane + one engine + the demo adapters, from nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.e2e.test_control_plane_engines import _free_port


def test_up_brings_up_the_stack_with_the_demo_adapters(tmp_path: Path) -> None:
    cp_port, engine_port = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")}
    cmd = [sys.executable, "-c", "import sys; from control_plane.up import main; sys.exit(main(sys.argv[1:]))",
           "--demo-dir", str(tmp_path / "demo"), "--port", str(cp_port), "--engine-port", str(engine_port),
           "--device", "cpu"]
    log = tmp_path / "up.log"
    with log.open("w") as out:
        process = subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                   env={**env, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while "loraplane up: control plane" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        token_file = tmp_path / ".loraplane" / "admin-token"
        assert token_file.stat().st_mode & 0o077 == 0
        token = token_file.read_text().strip()
        assert token not in log.read_text()  # written to the file, never printed
        auth = {"Authorization": f"Bearer {token}"}
        page = httpx.get(f"http://127.0.0.1:{cp_port}/v1/lora_adapters", headers=auth, timeout=10).json()
        assert [a["name"] for a in page["data"]] == ["demo-pirate", "demo-poet", "demo-short"]
        r = httpx.post(f"http://127.0.0.1:{engine_port}/v1/completions", timeout=60,
                       json={"model": "demo-poet", "prompt": "hi", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=40)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
