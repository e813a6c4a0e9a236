"""Real `loraplane engine` processes on loopback, for the tests that speak HTTP to a real engine.

`engine_server` is one server shared by the session (the common case); `start_engine(*flags)`
starts a dedicated one (its own metrics, or flags such as a tiny waiting queue) and stops it at
the end of the test. Each is started with --port 0 and reports the port it got on stdout.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
SERVED_NAME = "demo"
STARTUP_TIMEOUT_S = 180
_URL_LINE = re.compile(r"serving .* on (http://\S+)")
# Small limits keep the CPU tests quick and make the limit tests cheap.
SHARED_FLAGS = ("--max-model-len", "256", "--num-kv-blocks", "128", "--max-request-body-bytes", "262144")


@dataclass
class EngineServer:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    log: Path

    @property
    def api(self) -> str:
        return self.url + "/v1"

    def metric(self, name: str, labels: str = "") -> float:
        """From /metrics: the sum of the samples of `name` whose labels include `labels`, e.g.
        metric("loraplane_requests_total", 'outcome="abort"') counts aborts of every adapter."""
        return scrape_metric(self.url, name, labels)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def scrape_metric(url: str, name: str, labels: str = "") -> float:
    """The sum of the samples of `name` whose labels include `labels` on `url`/metrics (any of our
    processes); KeyError when there is none."""
    wanted = {pair for pair in labels.split(",") if pair}
    text = httpx.get(url + "/metrics", timeout=10).text
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        series, _, value = line.rpartition(" ")
        series_name, _, label_text = series.partition("{")
        if series_name == name and wanted <= set(label_text.rstrip("}").split(",")):
            total, found = total + float(value), True
    if not found:
        raise KeyError(f"{name}{{{labels}}}")
    return total


@contextlib.contextmanager
def run_engine(model_dir: Path, log: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[EngineServer]:
    cmd = [sys.executable, "-m", "shared.cli", "engine", "--model", str(model_dir)]
    cmd += [
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--device",
        "cpu",
        *flags,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log.open("w") as out:
        process = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = EngineServer("", process, log)
    try:
        server.url = _wait_until_serving(server)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_until_serving(server: EngineServer) -> str:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    url = None
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"engine exited with {server.process.returncode}:\n{server.log_tail()}")
        if url is None and (match := _URL_LINE.search(server.log.read_text(errors="replace"))):
            url = match.group(1)
        if url is not None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return url
        time.sleep(0.2)
    pytest.fail(f"engine not healthy after {STARTUP_TIMEOUT_S}s:\n{server.log_tail()}")


@pytest.fixture(scope="session")
def engine_server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    log = tmp_path_factory.mktemp("engine_logs") / "shared-engine.log"
    with run_engine(demo_model_dir, log, *SHARED_FLAGS) as server:
        yield server


@pytest.fixture
def start_engine(demo_model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., EngineServer]]:
    numbers = itertools.count()
    with contextlib.ExitStack() as stack:

        def start(*flags: str, env: dict[str, str] | None = None) -> EngineServer:
            log = tmp_path / f"engine-{next(numbers)}.log"
            return stack.enter_context(run_engine(demo_model_dir, log, *flags, env=env))

        yield start


@pytest.fixture
def openai_client(engine_server: EngineServer):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=engine_server.api, api_key="unused", max_retries=0, timeout=120)
