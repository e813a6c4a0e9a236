"""EngineCoreClient against a real engine-core process on the demo checkpoint.

The oracle for tokens is the same engine in this process (LLMEngine, whose own tests check it
against transformers and PEFT): what crosses the process boundary must not change a token.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from data_plane.adapters.loading.peft_loader import load_peft_adapter
from data_plane.adapters.loading.spec import loader_for
from data_plane.adapters.loading.transfer import share_adapter
from data_plane.adapters.registry import LoRARegistry
from data_plane.demo.adapters import DemoAdapter, write_lora_adapter
from data_plane.engine.core.client import EngineCoreClient
from data_plane.engine.core.threads import CORE_SPIN_COUNT
from data_plane.engine.llm_engine import LLMEngine
from data_plane.engine.protocol import EngineProtocol
from data_plane.engine.sequence import Request
from data_plane.lora.weights import TARGET_MODULES
from data_plane.model.config import ModelConfig
from shared.errors import EngineDeadError, InvalidRequestError, LoraplaneError
from tests.data_plane.adapters.loading.shared_files import unshared
from tests.data_plane.api.engines import MAX_MODEL_LEN, engine_config, greedy
from tests.data_plane.engine.protocol_check import mismatches

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]


@pytest.fixture
async def client(demo_model_dir: Path) -> AsyncIterator[EngineCoreClient]:
    client = EngineCoreClient.from_config(engine_config(demo_model_dir, enable_lora=True, max_loras=2))
    client.start()
    yield client
    await client.shutdown()


def children(pid: int) -> set[int]:
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(c) for c in (task / "children").read_text().split()}
    return found


def reference(demo_model_dir: Path, requests: list[Request], *, one_at_a_time: bool = False,
              **config: object) -> dict[str, list[int]]:
    engine = LLMEngine.from_config(engine_config(demo_model_dir, **{"enable_lora": True, "max_loras": 2, **config}))
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for batch in ([r] for r in requests) if one_at_a_time else [requests]:
        for r in batch:
            engine.add_request(r)
        while engine.has_work():
            for out in engine.step():
                for d in out.deltas:
                    tokens[out.request_id] += d.token_ids
    return tokens


async def collect(client: EngineCoreClient, request: Request) -> list[int]:
    return [t async for out in client.generate(request) for d in out.deltas for t in d.token_ids]


async def test_tokens_equal_the_in_process_engine_with_and_without_an_adapter(client, demo_model_dir, demo_adapter):
    assert mismatches(client, EngineProtocol) == []
    assert client.config.max_model_len == MAX_MODEL_LEN and client.vocab_size > 0
    requests = [Request(f"b{i}", p, greedy(6)) for i, p in enumerate(PROMPTS)]
    requests += [Request(f"l{i}", p, greedy(6), 1, demo_adapter.cache_namespace, demo_adapter)
                 for i, p in enumerate(PROMPTS)]
    got = await asyncio.gather(*(collect(client, r) for r in requests))
    want = reference(demo_model_dir, requests)
    assert dict(zip(want, got, strict=True)) == want
    assert want["b0"] != want["l0"]  # the adapter changed something, so it was applied
    assert client.stats().lora.adapters[1].loads == 1


async def test_pin_unpin_remove_cross_and_the_stats_follow(client, demo_adapter):
    await client.pin_lora(1, demo_adapter)
    assert client.stats().lora.adapters[1].pinned and client.stats().lora.slots_used == 1
    await client.unpin_lora(1)
    assert not client.stats().lora.adapters[1].pinned
    await client.remove_lora(1)
    assert 1 not in client.stats().lora.adapters and client.stats().lora.slots_used == 0
    with pytest.raises(InvalidRequestError, match="no weights"):  # the core dropped its copy too
        await collect(client, Request("x", [1, 2], greedy(2), 1, 0, None))


async def test_refusals_and_aborts(client):
    too_long = Request("long", [1] * MAX_MODEL_LEN, greedy(4))
    with pytest.raises(InvalidRequestError) as refused:
        await collect(client, too_long)
    assert refused.value.code == "context_length_exceeded"
    stream = client.generate(Request("a1", [1, 2, 3], greedy(40)))
    first = await anext(stream)
    assert not first.finished and first.prompt_token_ids == [1, 2, 3]
    await stream.aclose()  # the client went away: the core aborts the request
    for _ in range(200):
        if client.stats().num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert client.stats().num_running == 0 and client.stats().kv_blocks_used == 0


async def test_a_killed_core_fails_requests_in_flight_and_new_ones_at_once(client):
    stream = client.generate(Request("k1", [1, 2, 3], greedy(50)))
    await anext(stream)
    os.kill(client.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="engine-core process exited"):
        async for _ in stream:
            pass
    assert not client.healthy and "exited" in client.dead_reason
    with pytest.raises(EngineDeadError):
        await collect(client, Request("k2", [1], greedy(1)))
    with pytest.raises(EngineDeadError):
        await client.unpin_lora(1)


async def test_shutdown_stops_the_core_and_leaves_no_process(demo_model_dir, monkeypatch):
    monkeypatch.setenv("LORAPLANE_ADMIN_TOKEN", "admin-secret-1234")
    monkeypatch.setenv("LORAPLANE_CONTROL_PLANE_TOKEN", "cp-secret-5678")
    for openmp in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):  # unset: the core gets its own spin (threads.py)
        monkeypatch.delenv(openmp, raising=False)
    client = EngineCoreClient.from_config(engine_config(demo_model_dir, admin_token="admin-secret-1234"))
    client.start()
    assert client.pid in children(os.getpid())
    environ = Path(f"/proc/{client.pid}/environ").read_text().split("\0")
    assert not [v for v in environ if "secret" in v] and "OMP_NUM_THREADS=1" in environ  # the core holds no secret
    assert f"GOMP_SPINCOUNT={CORE_SPIN_COUNT}" in environ
    assert await collect(client, Request("s", [1, 2], greedy(3)))
    await client.shutdown()
    assert client.core.process.returncode == 0  # it stopped on its own, not killed
    assert client.pid not in children(os.getpid()) and client.healthy


def test_a_core_whose_parent_dies_exits(demo_model_dir, tmp_path):
    """The API process killed outright (no Shutdown, no SIGTERM): the core notices and exits."""
    import subprocess
    import sys
    import time

    script = tmp_path / "api.py"
    script.write_text(
        "import sys, time\n"
        "from data_plane.config import EngineConfig\n"
        "from data_plane.engine.core.client import EngineCoreClient\n"
        f"c = EngineCoreClient.from_config(EngineConfig(model={str(demo_model_dir)!r}, device='cpu', num_threads=1))\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    api = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                           cwd=Path(__file__).resolve().parents[4])
    core_pid = int(api.stdout.readline())
    api.kill()
    api.wait()
    for _ in range(100):
        if not Path(f"/proc/{core_pid}").exists() or "zombie" in Path(f"/proc/{core_pid}/status").read_text():
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{core_pid}").exists() or "zombie" in Path(f"/proc/{core_pid}/status").read_text()


def test_a_model_the_core_cannot_load_is_refused_with_its_reason(demo_model_dir, tmp_path):
    import json
    import shutil

    from shared.errors import UnsupportedModelError

    model = tmp_path / "odd"
    shutil.copytree(demo_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        EngineCoreClient.from_config(engine_config(model))
    assert not any("process_main" in Path(f"/proc/{c}/cmdline").read_text() for c in children(os.getpid())
                   if Path(f"/proc/{c}").exists())


async def test_an_adapter_dropped_and_read_again_is_handed_over_again(demo_model_dir, tmp_path):
    """The registry drops a host copy (and so its file) and reads it again; the core, told to drop its
    copy, gets the new file: the tokens stay the in-process engine's."""
    root = tmp_path / "adapters"
    spec = DemoAdapter(r=8, lora_alpha=16, target_modules=TARGET_MODULES)
    for name, seed in (("a", 1), ("b", 2)):
        write_lora_adapter(demo_model_dir, root / name, spec, seed=seed)
    config = engine_config(demo_model_dir, enable_lora=True, max_loras=1, max_cpu_loras=1, lora_roots=[str(root)])
    client = EngineCoreClient.from_config(config)
    client.start()
    try:
        registry = LoRARegistry(client, loader_for(config), base_name="demo", max_cpu_loras=1)
        await registry.load("a", str(root / "a"))
        (entry_a,) = registry.ready()
        first_file = entry_a.weights.shared.file
        await registry.load("b", str(root / "b"))  # one host copy at most: a's is dropped, its file with it
        assert entry_a.weights is None
        # the file goes with the last reference to a's weights, which a finished load's task may hold until
        # the event loop has run its callbacks (once, under a full suite's load, it was still there at once)
        for _ in range(100):
            gc.collect()
            if not os.path.exists(first_file):
                break
            await asyncio.sleep(0.05)
        assert not os.path.exists(first_file)
        got, files = [], []
        for name in ("a", "b", "a"):  # each one read again, and handed over again (the core holds one)
            lease = await registry.acquire(name)
            try:
                files.append(lease.weights.shared.file)
                request = Request(f"r{len(got)}", PROMPTS[0], greedy(6), lease.adapter_id, lease.cache_namespace,
                                  lease.weights)
                got.append(await collect(client, request))
            finally:
                lease.release()
            del lease, request
        gc.collect()
        assert not os.path.exists(files[0])  # dropped by the registry, then by the core: removed
        assert client.stats().lora.adapters[entry_a.adapter_id].loads == 2
    finally:
        await client.shutdown()
    load = loader_for(config)
    fresh = {name: load(str(root / name)) for name in ("a", "b")}
    requests = [Request(f"r{i}", PROMPTS[0], greedy(6), i + 1, fresh[name].cache_namespace, fresh[name])
                for i, name in enumerate(("a", "b", "a"))]
    want = reference(demo_model_dir, requests, one_at_a_time=True, max_loras=1, max_cpu_loras=1)
    assert got == list(want.values()) and got[0] != got[1]


async def test_the_same_weights_are_handed_over_again_after_the_core_dropped_them(demo_model_dir, demo_adapter, tmp_path):
    other = load_peft_adapter(write_lora_adapter(demo_model_dir, tmp_path / "o", DemoAdapter(r=8, lora_alpha=16,
                              target_modules=TARGET_MODULES), seed=5), ModelConfig.from_pretrained(demo_model_dir),
                              max_rank=8, allowed_roots=[str(tmp_path)])
    config = engine_config(demo_model_dir, enable_lora=True, max_loras=1, max_cpu_loras=1)
    client = EngineCoreClient.from_config(config)
    client.start()
    requests = [Request(f"s{i}", PROMPTS[1], greedy(5), adapter_id, weights.cache_namespace, weights)
                for i, (adapter_id, weights) in enumerate(((1, demo_adapter), (2, other), (1, demo_adapter)))]
    try:
        got = [await collect(client, r) for r in requests]  # 2 makes the core drop 1; then 1 crosses again
    finally:
        await client.shutdown()
    assert os.path.exists(demo_adapter.shared.file)  # still the loaded adapter's, as long as it lives
    assert got == list(reference(demo_model_dir, requests, one_at_a_time=True, max_loras=1, max_cpu_loras=1).values())


async def test_a_hand_over_whose_file_is_gone_refuses_that_adapter_and_the_core_serves_on(
        client, demo_model_dir, demo_adapter):
    weights = load_peft_adapter(demo_adapter.path, ModelConfig.from_pretrained(demo_model_dir), max_rank=8,
                                allowed_roots=[str(Path(demo_adapter.path).parent)])
    file = weights.shared.file
    weights.shared.remove()  # someone cleaned /dev/shm
    with pytest.raises(LoraplaneError, match="could not map adapter 1") as refused:
        await collect(client, Request("gone", PROMPTS[0], greedy(3), 1, weights.cache_namespace, weights))
    assert refused.value.status_code == 500 and not os.path.exists(file)  # and no zeroed file was made for it
    assert client.healthy
    assert len(await collect(client, Request("base", PROMPTS[0], greedy(3)))) == 3
    assert len(await collect(client, Request("ok", PROMPTS[0], greedy(3), 2, demo_adapter.cache_namespace,
                                             demo_adapter))) == 3


async def longest_stall(work: Callable[[], Awaitable[object]]) -> float:
    """The longest the event loop went without running a 1 ms timer while `work` ran (seconds)."""
    gaps: list[float] = []
    stop = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.02)
    gaps.clear()
    gc.disable()  # the collector's pauses are not what is measured
    try:
        await work()
    finally:
        gc.enable()
        stop.set()
        await ticker
    return max(gaps)


async def test_handing_a_large_adapter_over_does_not_stall_the_event_loop(demo_model_dir, tmp_path):
    """The first request of an 80 MB adapter sends its layout only: other streams' timers keep their pace,
    where copying it into a new file (the hand-over before) stalled the loop for the whole copy."""
    rank = 1024
    path = write_lora_adapter(demo_model_dir, tmp_path / "big", DemoAdapter(r=rank, lora_alpha=16,
                              target_modules=TARGET_MODULES), seed=3)
    big = load_peft_adapter(path, ModelConfig.from_pretrained(demo_model_dir), max_rank=rank,
                            allowed_roots=[str(tmp_path)])
    assert big.shared.size > 50_000_000
    copy = unshared(big)

    async def old_hand_over() -> None:
        share_adapter(copy)  # no shared file: every tensor copied into a new one, as every hand-over did

    async def first_request() -> None:
        tokens.extend(await collect(client, Request("big", PROMPTS[0], greedy(4), 1, big.cache_namespace, big)))

    tokens: list[int] = []
    client = EngineCoreClient.from_config(engine_config(demo_model_dir, enable_lora=True, max_loras=1,
                                                        max_lora_rank=rank))
    client.start()
    try:
        baseline = await longest_stall(old_hand_over)
        stall = await longest_stall(first_request)
    finally:
        await client.shutdown()
    assert len(tokens) == 4
    assert stall < baseline / 2, (stall, baseline)
