"""The adapter reader process reads exactly what the API process would read itself, hands the host copy's
file over to the API process, says the loader's refusals in the loader's words, and neither a reader that
dies nor an API process that dies leaves anything behind. The first load starts a reader, loads that meet
traffic a second; no load waits for one to start, and a load meeting traffic waits for a busy reader rather
than reading here."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from data_plane.adapters.artifacts.verified_files import VerifiedFiles
from data_plane.adapters.loading import reader_process
from data_plane.adapters.loading.reader_process import MAX_START_FAILURES, AdapterReaderProcess
from data_plane.adapters.loading.shared_tensors import file_prefix, shm_dir
from data_plane.adapters.loading.spec import AdapterReading
from data_plane.background import READER_NICENESS, lower_thread_priority
from data_plane.lora.errors import LoRAAdapterError
from shared.peft import CONFIG_NAME, WEIGHTS_NAME
from tests.data_plane.adapters.loading.shared_files import inside, mappings_of, own_shared_files
from tests.data_plane.adapters.loading.test_transfer import assert_same_weights


def ready_reader(reading: AdapterReading, verified: VerifiedFiles | None = None) -> AdapterReaderProcess:
    reader = AdapterReaderProcess(reading, verified)
    reader.start()
    assert reader.wait_ready(60)
    return reader


@pytest.fixture
def reader(reading: AdapterReading):
    reader = ready_reader(reading)
    yield reader
    reader.close()


@pytest.fixture(scope="module")
def shared_reader(reading: AdapterReading):
    """For the tests that leave the reader as they found it (each reader start imports torch: about 1.5 s),
    with the artifact cache's memo of verified files, as the engine's reader has."""
    reader = ready_reader(reading, VerifiedFiles())
    yield reader
    reader.close()


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def exited(pid: int) -> bool:
    """Whether the child `pid` has ended, all its threads (a peek: it stays to be reaped by its Popen)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def test_an_adapter_read_by_the_reader_is_the_one_read_here_in_a_file_this_process_owns(reader, reading, adapters):
    before = own_shared_files()
    got = reader(str(adapters / "a0"))
    assert_same_weights(got, reading.read(str(adapters / "a0")))
    [pid] = reader.pids()
    assert pid != os.getpid()
    file = got.shared.file
    assert Path(file).name.startswith(file_prefix(os.getpid()))  # named for this process: the sweep keeps it
    assert own_shared_files() - before == {Path(file)}
    ranges = mappings_of(file)
    assert all(inside(m.a_t, ranges) and inside(m.b_t, ranges) for mods in got.layers.values() for m in mods.values())
    # the reader let go of its mapping once it answered; the file is this process's to remove
    assert wait_for(lambda: file not in Path(f"/proc/{pid}/maps").read_text())
    del got
    gc.collect()
    assert not Path(file).exists()
    # the next load goes to the same reader, started once
    assert_same_weights(reader(str(adapters / "a1")), reading.read(str(adapters / "a1")))
    assert reader.pids() == [pid]


@pytest.mark.parametrize("name", ["a2", "elsewhere", "a0\0"])
def test_the_loaders_refusals_come_back_in_its_words_and_leave_no_file(shared_reader, reading, adapters, tmp_path,
                                                                      name):
    path = str(tmp_path if name == "elsewhere" else adapters / name)  # rank 16 > 8; outside the roots; NUL
    with pytest.raises(LoRAAdapterError) as here:
        reading.read(path)
    files = own_shared_files()
    with pytest.raises(LoRAAdapterError) as there:
        shared_reader(path)
    assert there.value.to_body() == here.value.to_body()
    assert own_shared_files() == files


def test_hashes_known_here_cross_to_the_reader_and_held_bytes_are_read_here(reader, reading, adapters):
    folder = adapters / "a1"
    verified = VerifiedFiles()
    verified.remember(folder / WEIGHTS_NAME, "0" * 64)  # "hashed already": the reader must not hash it again
    reader.verified = verified
    got = reader(str(folder))
    assert (got.description.sha256 == reading.read(str(folder), verified).description.sha256
            != reading.read(str(folder)).description.sha256)
    reader.close()
    # a version just fetched is held in this process's memory: read from it here, no reader needed
    held = VerifiedFiles()
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        held.hold(folder / name, "", bytearray((folder / name).read_bytes()))
    reader = AdapterReaderProcess(reading, held)
    assert_same_weights(reader(str(folder)), reading.read(str(folder), held))
    assert reader.pids() == []


def test_a_reader_that_dies_fails_only_its_load_and_a_later_load_starts_another(reader, reading, adapters):
    reader(str(adapters / "a0"))
    [first] = reader.pids()
    os.kill(first, signal.SIGSTOP)  # it takes the next request but does not answer: killed mid-load below
    failure: list[BaseException] = []
    load = threading.Thread(target=lambda: failure.append(pytest.raises(LoRAAdapterError, reader, str(adapters / "a1")).value))
    load.start()
    time.sleep(0.3)
    os.kill(first, signal.SIGKILL)
    load.join(10)
    assert "adapter reader process died" in failure[0].message and "exit code -9" in failure[0].message
    # the next load reads here while another reader starts
    assert_same_weights(reader(str(adapters / "a1")), reading.read(str(adapters / "a1")))
    assert reader.wait_ready(60)
    [second] = reader.pids()
    assert second != first
    os.kill(second, signal.SIGKILL)  # dying while idle costs no load: the next one reads here, starts a reader
    assert wait_for(lambda: exited(second))
    assert_same_weights(reader(str(adapters / "a0")), reading.read(str(adapters / "a0")))
    assert reader.pids() not in ([first], [second], [])


def test_a_load_meeting_traffic_waits_for_a_busy_reader_instead_of_reading_here(reading, adapters, monkeypatch):
    """While the engine has requests, a read here would hold the API process's GIL between the streams' tokens:
    a load that finds the ready reader busy waits for it (bounded by BUSY_WAIT_S), then reads here."""
    reader = AdapterReaderProcess(reading, workers=1, busy=lambda: True)
    reader.start()
    assert reader.wait_ready(60)
    [pid] = reader.pids()
    os.kill(pid, signal.SIGSTOP)  # it takes the first load and holds it
    try:
        pool = ThreadPoolExecutor(2)
        first = pool.submit(reader, str(adapters / "a0"))
        time.sleep(0.2)
        second = pool.submit(reader, str(adapters / "a1"))
        time.sleep(1.0)  # a read here takes a few milliseconds
        assert not second.done() and not first.done()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert_same_weights(first.result(30), reading.read(str(adapters / "a0")))
    assert_same_weights(second.result(30), reading.read(str(adapters / "a1")))  # from the reader, once free
    assert reader.pids() == [pid]

    monkeypatch.setattr(reader_process, "BUSY_WAIT_S", 0.3)
    os.kill(pid, signal.SIGSTOP)
    try:
        first = pool.submit(reader, str(adapters / "a0"))
        time.sleep(0.2)
        # the wait runs out: read here (a stuck reader never holds a load for ever)
        assert_same_weights(reader(str(adapters / "a1")), reading.read(str(adapters / "a1")))
        assert not first.done()
    finally:
        os.kill(pid, signal.SIGCONT)
    first.result(30)
    pool.shutdown()
    reader.close()


def test_readers_that_die_while_starting_cost_no_load_and_are_given_up_after_a_few(reading, adapters):
    reader = AdapterReaderProcess(reading, workers=1)
    for attempt in range(MAX_START_FAILURES):
        assert_same_weights(reader(str(adapters / "a0")), reading.read(str(adapters / "a0")))  # read here
        [starting] = reader.pids()  # and a reader starts for the next loads
        os.kill(starting, signal.SIGKILL)  # never ready
        assert not reader.wait_ready(30)  # False once none is starting, not after the timeout
        assert reader.pids() == [], attempt
    assert_same_weights(reader(str(adapters / "a0")), reading.read(str(adapters / "a0")))
    assert reader.pids() == []  # given up: loads read on their own threads from now on
    reader.close()


def test_the_first_load_starts_a_reader_at_low_priority_without_secrets_and_traffic_a_second(reading, adapters,
                                                                                            monkeypatch):
    monkeypatch.setenv("LORAPLANE_ADMIN_TOKEN", "s3cret-admin")
    requests = 0
    reader = AdapterReaderProcess(reading, busy=lambda: requests > 0)
    assert reader.pids() == [] and not reader.wait_ready(0)  # none before a load
    # the first load reads here (none is ready), never waiting, and starts a reader for the loads after it, so
    # that it is ready when traffic comes; started from a thread at a lower priority still, as the API's
    # reader threads are
    started = ThreadPoolExecutor(1, initializer=lower_thread_priority).submit(reader, str(adapters / "a0"))
    assert_same_weights(started.result(), reading.read(str(adapters / "a0")))
    [pid] = reader.pids()
    environ = Path(f"/proc/{pid}/environ").read_bytes()
    assert b"s3cret-admin" not in environ and b"PATH=" in environ
    assert reader.wait_ready(60)
    assert os.getpriority(os.PRIO_PROCESS, pid) == READER_NICENESS  # below the engine, not below that
    reader.start(import_first=True)  # one is running: no second
    assert reader.pids() == [pid]
    files = own_shared_files()
    got = reader(str(adapters / "a1"))  # an idle engine's load goes to the reader that is there
    assert wait_for(lambda: got.shared.file not in Path(f"/proc/{pid}/maps").read_text())  # it was the reader's
    assert own_shared_files() - files == {Path(got.shared.file)}

    # while the engine has requests, a load that finds the reader busy starts a second (and waits for a reader to
    # free, BUSY_WAIT_S at most)
    requests = 3
    os.kill(pid, signal.SIGSTOP)
    try:
        pool = ThreadPoolExecutor(2)
        held = pool.submit(reader, str(adapters / "a0"))
        time.sleep(0.2)
        assert_same_weights(pool.submit(reader, str(adapters / "a1")).result(60), reading.read(str(adapters / "a1")))
        assert not held.done() and len(reader.pids()) == 2
    finally:
        os.kill(pid, signal.SIGCONT)
    held.result(30)
    pool.shutdown()
    reader.close()
    assert not Path(f"/proc/{pid}").exists()
    assert not reader.wait_ready(0.1)
    with pytest.raises(LoRAAdapterError, match="shutting down"):
        reader(str(adapters / "a0"))


def test_a_reader_started_with_the_engine_imports_first_then_reads_at_low_priority(reading):
    """(an engine starting up with --lora-modules: app.py) its priority is the caller's while it imports torch,
    READER_NICENESS once it is ready for loads."""
    reader = AdapterReaderProcess(reading)
    reader.start(import_first=True)
    [pid] = reader.pids()
    assert "--import-first" in Path(f"/proc/{pid}/cmdline").read_text()
    assert reader.wait_ready(60)
    assert os.getpriority(os.PRIO_PROCESS, pid) == READER_NICENESS
    reader.close()


def test_readers_end_with_an_api_process_killed_outright(reading, adapters, tmp_path):
    """A SIGKILLed API process runs no clean-up: its readers see the socket close and exit; the host copy's
    file, named for the dead process, is what the next engine's sweep removes."""
    script = textwrap.dedent(f"""
        import os, pickle, sys
        from data_plane.adapters.loading.reader_process import MAX_START_FAILURES, AdapterReaderProcess
        reader = AdapterReaderProcess(pickle.loads({__import__("pickle").dumps(reading)!r}))
        reader.start()
        assert reader.wait_ready(60)
        weights = reader({str(adapters / "a0")!r})
        print(reader.pids()[0], weights.shared.file, flush=True)
        sys.stdin.read()
    """)
    api = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                           cwd=Path(__file__).parents[4])
    pid, file = api.stdout.readline().split()
    api.kill()
    api.wait()
    assert wait_for(lambda: not Path(f"/proc/{pid}").exists())
    assert Path(file).parent == shm_dir() and Path(file).name.startswith(file_prefix(api.pid))
    from data_plane.adapters.loading.shared_tensors import sweep_orphans

    # (an engine starting meanwhile, as under pytest-xdist, may have swept it already)
    assert Path(file) in sweep_orphans() or not Path(file).exists()
