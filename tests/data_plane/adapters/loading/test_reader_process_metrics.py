"""/metrics shows the adapter reader processes by state and where loads were read: a load that meets
running requests on a thread of the API process (no reader ready yet) is the count that says streams
were slowed, so it must be visible."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from litestar.testing import TestClient
from prometheus_client import CollectorRegistry

from data_plane.adapters.loading import reader_process
from data_plane.adapters.loading.reader_process import AdapterReaderProcess
from data_plane.adapters.loading.reader_process_metrics import AdapterReaderCollector
from data_plane.api.app import create_app
from tests.data_plane.api.engines import make_engine
from tests.data_plane.engine.core.test_client import children


def figures(registry: CollectorRegistry) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    states = {s: registry.get_sample_value("loraplane_adapter_reader_processes", {"state": s})
              for s in ("starting", "idle", "reading")}
    reads = {(w, s): registry.get_sample_value("loraplane_adapter_reads_total", {"where": w, "serving": s})
             for w in ("reader_process", "api_thread") for s in ("false", "true")}
    return states, reads


def test_reader_states_and_reads_by_place_follow_the_loads(reading, adapters, monkeypatch):
    requests = 0
    readers = AdapterReaderProcess(reading, workers=1, busy=lambda: requests > 0)
    registry = CollectorRegistry()
    registry.register(AdapterReaderCollector(readers))
    states, reads = figures(registry)
    assert states == {"starting": 0, "idle": 0, "reading": 0} and set(reads.values()) == {0}

    readers(str(adapters / "a0"))  # read here (none ready) while the first reader starts
    states, reads = figures(registry)
    assert reads[("api_thread", "false")] == 1
    assert states["starting"] + states["idle"] == 1 and states["reading"] == 0
    assert readers.wait_ready(60)
    assert figures(registry)[0] == {"starting": 0, "idle": 1, "reading": 0}

    requests = 2
    [pid] = readers.pids()
    monkeypatch.setattr(reader_process, "BUSY_WAIT_S", 0.3)
    os.kill(pid, signal.SIGSTOP)  # holds the next load, so it shows as reading
    load = threading.Thread(target=readers, args=(str(adapters / "a1"),))
    load.start()
    try:
        deadline = time.monotonic() + 10
        while figures(registry)[0]["reading"] != 1:
            assert time.monotonic() < deadline, figures(registry)
            time.sleep(0.01)
        assert figures(registry)[0] == {"starting": 0, "idle": 0, "reading": 1}
        readers(str(adapters / "a0"))  # meets requests, and the wait for the busy reader runs out: read here
    finally:
        os.kill(pid, signal.SIGCONT)
    load.join(30)
    states, reads = figures(registry)
    assert states == {"starting": 0, "idle": 1, "reading": 0}
    assert reads == {("reader_process", "false"): 0, ("reader_process", "true"): 1,
                     ("api_thread", "false"): 1, ("api_thread", "true"): 1}
    readers.close()


@pytest.mark.parametrize("with_readers", [True, False])
def test_the_engines_metrics_carry_the_readers_when_it_has_them(demo_model_dir: Path, with_readers: bool):
    engine = make_engine(demo_model_dir, enable_lora=True, max_lora_rank=16, adapter_reader_process=with_readers)
    with TestClient(create_app(engine, engine.config)) as client:
        text = client.get("/metrics").text
    lines = ['loraplane_adapter_reader_processes{state="starting"} 0.0',
             'loraplane_adapter_reads_total{serving="true",where="api_thread"} 0.0']
    assert all((line in text.splitlines()) == with_readers for line in lines), text


def test_an_engine_started_with_adapters_starts_its_reader_with_it(demo_model_dir: Path, adapters: Path):
    """--lora-modules: the reader is started as the engine starts, importing torch before it lowers its
    priority (--import-first), not by the first load at its low priority once traffic keeps the CPUs busy."""
    engine = make_engine(demo_model_dir, enable_lora=True, max_lora_rank=16, lora_roots=[str(adapters)],
                         lora_modules={"first": str(adapters / "a0")})
    with TestClient(create_app(engine, engine.config)) as client:
        text = client.get("/metrics").text
        readers = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in children(os.getpid())]
        readers = [argv for argv in readers if b"data_plane.adapters.loading.reader_process_main" in argv]
    assert sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("loraplane_adapter_reader_processes{")) == 1, text
    assert [b"--import-first" in argv for argv in readers] == [True]
