"""EngineCoreClient against a real engine-core process on the demo checkpoint.

The oracle for tokens is the same engine in this process (LLMEngine, whose own tests check it
against transformers and PEFT): what crosses the process boundary must not change a token.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from data_plane.engine.core.client import EngineCoreClient
from data_plane.engine.llm_engine import LLMEngine
from data_plane.engine.protocol import EngineProtocol
from data_plane.engine.sequence import Request
from shared.errors import EngineDeadError, InvalidRequestError
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


def reference(demo_model_dir: Path, requests: list[Request]) -> dict[str, list[int]]:
    engine = LLMEngine.from_config(engine_config(demo_model_dir, enable_lora=True, max_loras=2))
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for r in requests:
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
    client = EngineCoreClient.from_config(engine_config(demo_model_dir, admin_token="admin-secret-1234"))
    client.start()
    assert client.pid in children(os.getpid())
    environ = Path(f"/proc/{client.pid}/environ").read_text()
    assert "secret" not in environ and "OMP_NUM_THREADS=1" in environ  # the core holds no secret
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
