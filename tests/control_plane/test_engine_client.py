"""EngineClient's retry policy: connection errors and 5xx are retried with backoff, a 4xx is final.

The policy is checked with httpx's in-process MockTransport (it scripts a 5xx, which a healthy real
engine does not give on demand); calls to real engines are in domain/adapters/test_push.py and e2e.
"""

from __future__ import annotations

import httpx
import pytest

from control_plane.engine_client import EngineCallError, EngineClient


def scripted(*answers: int | type[Exception]) -> tuple[httpx.MockTransport, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = answers[min(len(seen), len(answers)) - 1]
        if isinstance(answer, type):
            raise answer("scripted", request=request)
        return httpx.Response(answer, json={"error": {"message": f"status {answer}"}} if answer >= 400 else {})

    return httpx.MockTransport(handle), seen


async def test_5xx_and_connect_errors_are_retried_then_succeed() -> None:
    transport, seen = scripted(httpx.ConnectError, 503, 200)
    client = EngineClient("tok", 5, backoff_s=0.001, transport=transport)
    await client.load("http://e:1", "a", "/p", pinned=False, load_inplace=True)
    assert len(seen) == 3 and seen[0].headers["authorization"] == "Bearer tok"


async def test_4xx_is_not_retried_and_the_message_names_status_not_token() -> None:
    transport, seen = scripted(409)
    client = EngineClient("s3cret", 5, backoff_s=0.001, transport=transport)
    with pytest.raises(EngineCallError) as info:
        await client.load("http://e:1", "a", "/p", pinned=False, load_inplace=True)
    assert len(seen) == 1 and info.value.status == 409 and "status 409" in info.value.message
    assert "s3cret" not in info.value.message


async def test_attempts_are_bounded() -> None:
    transport, seen = scripted(500)
    client = EngineClient(None, 5, max_attempts=3, backoff_s=0.001, transport=transport)
    with pytest.raises(EngineCallError, match="500"):
        await client.stats("http://e:1")
    assert len(seen) == 3 and "authorization" not in seen[0].headers


async def test_unloading_what_an_engine_does_not_hold_is_done() -> None:
    transport, seen = scripted(404)
    assert await EngineClient(None, 5, transport=transport).unload("http://e:1", "a") is not None
    assert len(seen) == 1
