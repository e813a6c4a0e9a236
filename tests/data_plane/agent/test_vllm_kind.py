"""The vllm engine kind (data_plane/agent/vllm.py) against a vLLM that misbehaves: a real HTTP server on
loopback standing in for a broken vLLM (a server that hangs, answers garbage, answers too much, or fails
with a hostile message). Each is one failed engine call (EngineCallFailed, a 502) within the deadline, its
message sanitized and bounded; the agent and the fleet go on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from litestar import Litestar, MediaType, Request, Response, route

from data_plane.agent.kind import EngineCallFailed
from data_plane.agent.vllm import MAX_BODY_BYTES, VllmEngine
from tests.control_plane.engines import serve_app
from tests.e2e.test_control_plane_engines import _free_port as free_port

DEADLINE_S = 1.0


@route("/{path:path}", http_method=["GET", "POST"])
async def broken(request: Request, path: str) -> Response:
    behaviour = request.app.state.behaviour
    if behaviour == "hang":
        await asyncio.sleep(30)
    if behaviour == "garbage":
        return Response(b"[1, 2, 3]", media_type=MediaType.JSON, status_code=200)
    if behaviour == "huge":
        return Response(b"x" * (MAX_BODY_BYTES + 1), media_type=MediaType.TEXT, status_code=200)
    if behaviour == "not-metrics":
        return Response(b"this is { not prometheus\n\x00\xff", media_type=MediaType.TEXT, status_code=200)
    # a hostile error: control characters, an escape sequence, a secret-looking URL, and far too long
    text = "boom\x1b[31m\r\nInjected: header http://user:pass@10.0.0.1/x " + "y" * 5000
    return Response({"error": {"message": text}}, status_code=500)


@pytest.fixture(scope="module")
def broken_vllm() -> Iterator[tuple[str, Litestar]]:
    app = Litestar([broken])
    with serve_app(app, free_port()) as url:
        yield url, app


def call(url: str, what: str):  # noqa: ANN201  (the call's answer, or its exception)
    async def run():  # noqa: ANN202
        engine = VllmEngine(url, timeout_s=DEADLINE_S)
        try:
            if what == "load":
                return await engine.load("a", Path("/adapters/x"), False)
            return await getattr(engine, what)()
        finally:
            await engine.aclose()
    return asyncio.run(run())


@pytest.mark.parametrize(("behaviour", "what", "expected"), [
    ("hang", "listing", f"no complete answer within {DEADLINE_S:g} s"),
    ("hang", "load", f"no complete answer within {DEADLINE_S:g} s"),
    ("garbage", "listing", "invalid reply"),
    ("huge", "stats", f"exceeds {MAX_BODY_BYTES} bytes"),
    ("error", "load", "vLLM refused to load a"),
])
def test_a_misbehaving_vllm_is_one_failed_call_within_the_deadline(
        broken_vllm: tuple[str, Litestar], behaviour: str, what: str, expected: str) -> None:
    url, app = broken_vllm
    app.state.behaviour = behaviour
    started = time.monotonic()
    with pytest.raises(EngineCallFailed) as failed:
        call(url, what)
    assert failed.value.status_code == 502
    message = failed.value.message
    assert expected in message, message
    assert time.monotonic() - started < 10 * DEADLINE_S  # a hang ends at the deadline, not at the server's 30 s
    assert len(message) < 1000 and message.isprintable(), repr(message)
    assert "user:pass" not in message and "\x1b" not in message


def test_an_unhealthy_answer_is_a_reason_not_an_exception(broken_vllm: tuple[str, Litestar]) -> None:
    url, app = broken_vllm
    app.state.behaviour = "hang"
    reason = call(url, "health")
    assert reason is not None and "no complete answer" in reason
    app.state.behaviour = "error"
    reason = call(url, "health")
    assert reason is not None and reason.startswith("vLLM /health: ") and len(reason) < 1000
