"""`loraplane up` (control_plane.up): control plane + one engine + the demo adapters, from nothing; no
secret on any child's command line; a SIGTERM (as a process manager sends) stops and reaps the children."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx

from tests.e2e.test_control_plane_engines import _free_port


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError):
                children = [int(c) for c in (task / "children").read_text().split()]
                out += children
                todo += children
    return out


def alive(pid: int) -> bool:
    """Running (a zombie awaiting its reaper counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_up(tmp_path: Path, cp_port: int, engine_port: int, *flags: str, stdout: IO[str],
             stderr: IO[str] | int) -> subprocess.Popen:
    """`loraplane up` in tmp_path (its state under tmp_path/.loraplane, the demo model in tmp_path/demo),
    with no LORAPLANE_* variable of the caller's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")}
    cmd = [sys.executable, "-c", "import sys; from control_plane.up import main; sys.exit(main(sys.argv[1:]))",
           "--demo-dir", str(tmp_path / "demo"), "--port", str(cp_port), "--engine-port", str(engine_port),
           "--device", "cpu", *flags]
    return subprocess.Popen(cmd, cwd=tmp_path, stdout=stdout, stderr=stderr, env={**env, "PYTHONUNBUFFERED": "1"})


def wait_until_up(process: subprocess.Popen, out: Path, log: Path, timeout_s: float = 120) -> None:
    """Until `up` says where the stack is (on stdout, in `out`); `log` is shown if it exits first."""
    deadline = time.monotonic() + timeout_s
    while "loraplane up: control plane" not in out.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.3)


def test_up_brings_up_the_stack_with_the_demo_adapters(tmp_path: Path) -> None:
    cp_port, engine_port = _free_port(), _free_port()
    log = tmp_path / "up.log"
    with log.open("w") as out:
        process = start_up(tmp_path, cp_port, engine_port, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_up(process, log, log)
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

        # every secret travels in the environment: none is on a command line (readable by all in `ps`)
        secrets = [(tmp_path / ".loraplane" / f).read_text().strip() for f in ("admin-token", "engine-token",
                                                                              "engine-cp-token")]
        children = descendants(process.pid)
        assert len(children) >= 2
        for pid in children:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            assert not any(s in cmdline for s in secrets), cmdline
        # the engine registered with its own engine token: the admin token is not in its environment
        engine_pid = next(p for p in children if "engine" in Path(f"/proc/{p}/cmdline").read_bytes().decode())
        environ = Path(f"/proc/{engine_pid}/environ").read_bytes().decode(errors="replace")
        assert secrets[0] not in environ and secrets[2] in environ

        # SIGTERM, as a process manager sends: the children are stopped and reaped, none left as an orphan
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in children if alive(pid)] == []
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=40)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
