"""A control plane and one engine as real processes on loopback, for the bench scripts (soak, attacks), and
the helpers the fleet scripts share: free ports, processes started and stopped, their CPU seconds, engines'
admin tokens.

`stack(tmp, base, adapter_root, database_url)` starts `loraplane control` and `loraplane engine
--enable-lora --control-plane …` on the demo model with fresh secrets (passed through the environment
only), waits until the engine has registered, and stops both on exit.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
ENGINE_NAME = "bench-engine"


def engine_admin_token(secret: str, engine: str) -> str:
    """Engine `engine`'s admin token as the control plane derives it from `secret`: control_plane/engine_tokens.py,
    loaded by its path (run as `python bench/x.py`, this folder is first on sys.path and bench/control_plane.py
    shadows the package)."""
    spec = importlib.util.spec_from_file_location("loraplane_engine_tokens", REPO / "control_plane" / "engine_tokens.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.engine_admin_token(secret, engine))


def cpu_seconds(pid: int, reaped_children: bool = False) -> float:
    """utime + stime of a process, all its threads (/proc/<pid>/stat fields 14 and 15, in clock ticks);
    with `reaped_children`, plus cutime + cstime (16 and 17: its children that ended and were waited for).
    OSError once it is gone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(f) for f in fields[11:15 if reaped_children else 13])
    return ticks / os.sysconf("SC_CLK_TCK")


async def sse_events(response: Any) -> AsyncIterator[tuple[float, bytes]]:
    """Each server-sent event of an aiohttp streaming `response`, with the perf_counter time the read that
    completed it returned: every byte is read as a user would, one call per read, not one per line."""
    rest = b""
    async for data in response.content.iter_any():
        now = time.perf_counter()
        *events, rest = (rest + data).split(b"\n\n")
        for event in events:
            yield now, event


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process(cmd: list[str], env: dict[str, str], log: Path, url: str, niceness: int = 0) -> Iterator[subprocess.Popen]:
    """Start `cmd`, wait until `url`/health answers 200, and terminate (then kill) it on exit."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=(lambda: os.nice(niceness)) if niceness else None)
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{cmd[3]} did not start; see {log}:\n{log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        yield proc
    finally:
        stop(proc, 30)


def stop(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM, then SIGKILL if it has not ended within `timeout_s`; reaped either way."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Stack:
    cp: str  # control plane base URL
    engine: str  # engine base URL
    cp_proc: subprocess.Popen
    engine_proc: subprocess.Popen
    admin_token: str  # the control plane's
    engine_admin_token: str  # the engine's admin endpoints'
    database_url: str

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.cp, headers={"Authorization": f"Bearer {self.admin_token}"}, timeout=60)


@contextlib.contextmanager
def stack(tmp: Path, base: Path, adapter_root: Path, database_url: str, *engine_flags: str,
          control_plane_niceness: int = 0) -> Iterator[Stack]:
    """`control_plane_niceness`: run the control plane at a lower priority, standing in for a control plane on
    another host (on one small machine it otherwise takes cores from the engine it serves)."""
    admin, read, engine_admin, engine_cp = (secrets.token_urlsafe(16) for _ in range(4))
    cp_port, engine_port = free_port(), free_port()
    cp, engine = f"http://127.0.0.1:{cp_port}", f"http://127.0.0.1:{engine_port}"
    cp_env = {**os.environ, "LORAPLANE_ADMIN_TOKENS": admin, "LORAPLANE_READ_TOKENS": read,
              "LORAPLANE_ENGINE_ADMIN_TOKEN": engine_admin, "LORAPLANE_ENGINE_CREDENTIALS": f"{ENGINE_NAME}={engine_cp}",
              "LORAPLANE_DATABASE_URL": database_url, "LORAPLANE_RECONCILE_INTERVAL_S": "2",
              "LORAPLANE_LOG_LEVEL": "warning"}
    engine_token = engine_admin_token(engine_admin, ENGINE_NAME)  # the engine's own, derived from the secret
    engine_env = {**os.environ, "LORAPLANE_ADMIN_TOKEN": engine_token, "LORAPLANE_CONTROL_PLANE_TOKEN": engine_cp}
    cp_cmd = [sys.executable, "-m", "shared.cli", "control", "--port", str(cp_port), "--lora-roots", str(adapter_root)]
    engine_cmd = [sys.executable, "-m", "shared.cli", "engine", "--model", str(base), "--served-model-name", "demo",
                  "--port", str(engine_port), "--device", "cpu", "--enable-lora", "--lora-roots", str(adapter_root),
                  "--control-plane", cp, "--engine-name", ENGINE_NAME, "--max-model-len", "256",
                  "--num-kv-blocks", "128", "--log-level", "warning", *engine_flags]
    with process(cp_cmd, cp_env, tmp / "control.log", cp, control_plane_niceness) as cp_proc, \
            process(engine_cmd, engine_env, tmp / "engine.log", engine) as engine_proc:
        running = Stack(cp, engine, cp_proc, engine_proc, admin, engine_token, database_url)
        with running.admin() as client:
            deadline = time.monotonic() + 30
            while not any(e["name"] == ENGINE_NAME for e in client.get("/v1/engines").json()["data"]):
                if time.monotonic() > deadline:
                    raise SystemExit("the engine did not register with the control plane")
                time.sleep(0.2)
        yield running
