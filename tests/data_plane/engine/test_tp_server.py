"""A tensor-parallel engine behind the HTTP API: it serves, and a rank that dies fails it loudly."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from tests.data_plane.api.conftest import SERVED_NAME, run_engine

GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 8}


def _descendants(pid: int) -> list[int]:
    children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return children + [d for c in children for d in _descendants(c)]


def _spawned_ranks(pid: int) -> list[int]:
    """Processes started by multiprocessing's spawn (the TP ranks), not its resource tracker: children
    of the engine-core process (rank 0), itself a child of the server."""
    ranks = []
    for child in _descendants(pid):
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline:
            ranks.append(child)
    return ranks


def test_tp2_server_serves_and_reports_a_dead_rank(demo_model_dir, tmp_path):
    flags = ("--tensor-parallel-size", "2", "--num-kv-blocks", "64")
    with run_engine(demo_model_dir, tmp_path / "tp.log", *flags) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"model": SERVED_NAME, "prompt": "The lighthouse keeper", **GREEDY}
        first = http.post("/v1/completions", json=body)
        assert first.status_code == 200, first.text
        assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        ranks = _spawned_ranks(server.process.pid)
        assert len(ranks) == 1
        os.kill(ranks[0], signal.SIGKILL)
        time.sleep(0.5)
        failed = http.post("/v1/completions", json=body)
        assert failed.status_code == 503 and "rank 1 died" in failed.json()["error"]["message"]
        health = http.get("/health")
        assert health.status_code == 503 and "rank 1 died" in health.text
        # never a silent fallback: the next request is refused too
        assert http.post("/v1/completions", json=body).status_code == 503
