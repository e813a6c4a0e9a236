"""A client that goes away mid-request makes the engine abort it: KV blocks return, the abort is counted."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.data_plane.api.conftest import SERVED_NAME, EngineServer

LONG = {"model": SERVED_NAME, "max_tokens": 1500, "temperature": 0.0, "ignore_eos": True}
MESSAGES = [{"role": "user", "content": "Write a very long story."}]


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("condition not reached in time")
        time.sleep(0.1)


def idle(server: EngineServer) -> bool:
    return (
        server.metric("loraplane_kv_blocks_used") == 0
        and server.metric("loraplane_running_sequences") == 0
        and server.metric("loraplane_waiting_sequences") == 0
    )


@pytest.fixture
def server(start_engine) -> EngineServer:
    return start_engine("--num-kv-blocks", "256", "--max-model-len", "2048")


def test_stream_disconnect_aborts_and_frees_kv_blocks(server):
    with (
        httpx.Client(base_url=server.url, timeout=60) as client,
        client.stream(
            "POST", "/v1/chat/completions", json={**LONG, "messages": MESSAGES, "stream": True}
        ) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        received = [next(lines) for _ in range(10)]
        assert any(line.startswith("data: {") for line in received)
        assert server.metric("loraplane_kv_blocks_used") > 0  # still generating
        # leaving both blocks closes the connection mid-stream
    wait_for(lambda: server.metric("loraplane_requests_total", 'outcome="abort"') == 1)
    wait_for(lambda: idle(server))
    assert server.metric("loraplane_requests_total", 'outcome="ok"') == 0


def test_non_streaming_disconnect_aborts_too(server):
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json={**LONG, "prompt": "Once upon a time"}, timeout=1.0)
    wait_for(lambda: server.metric("loraplane_requests_total", 'outcome="abort"') == 1)
    wait_for(lambda: idle(server))
    # and the server still answers
    r = httpx.post(
        server.url + "/v1/completions", json={"model": SERVED_NAME, "prompt": "hi", "max_tokens": 3}
    )
    assert r.status_code == 200
    assert server.metric("loraplane_requests_total", 'outcome="ok"') == 1
