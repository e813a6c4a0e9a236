"""Requests that once broke or starved a real engine process: each gets a 4xx naming the field, and
the engine keeps serving (its /health stays 200)."""

from __future__ import annotations

import httpx
import pytest

from tests.data_plane.api.conftest import SERVED_NAME, EngineServer
from tests.data_plane.api.test_errors import COMPLETIONS, openai_error, still_serving


def completion(**fields) -> dict:
    return {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 4, **fields}


def healthy(server: EngineServer) -> None:
    r = httpx.get(server.url + "/health", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text


def test_a_seed_past_64_bits_is_400_and_the_engine_lives_on(engine_server):
    r = httpx.post(engine_server.url + COMPLETIONS, json=completion(seed=18446744073709551615, n=2), timeout=60)
    assert openai_error(r, 400)["param"] == "seed"
    healthy(engine_server)
    # the largest accepted seed, with several samples, runs
    r = httpx.post(engine_server.url + COMPLETIONS, json=completion(seed=2**63 - 1, n=2), timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    still_serving(engine_server)
    healthy(engine_server)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 10000, "max_tokens": 8}, "n"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
        ({"stop": "x" * 257}, "stop"),
        ({"stop": ["ok", "y" * 257]}, "stop[1]"),
    ],
)
def test_requests_that_would_starve_others_are_400(engine_server, fields, param):
    r = httpx.post(engine_server.url + COMPLETIONS, json=completion(**fields), timeout=60)
    assert openai_error(r, 400)["param"] == param
    still_serving(engine_server)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_prompt_far_over_the_context_is_refused_by_its_length_before_tokenizing(engine_server, path):
    text = "word " * 50_000  # 250,000 characters: under the body limit, far over 256 tokens x 16
    body = (
        completion(prompt=text)
        if path == COMPLETIONS
        else {"model": SERVED_NAME, "messages": [{"role": "user", "content": text}]}
    )
    error = openai_error(httpx.post(engine_server.url + path, json=body, timeout=60), 400)
    assert error["code"] == "context_length_exceeded" and "characters" in error["message"]
    assert error["param"] == ("prompt" if path == COMPLETIONS else "messages")
    healthy(engine_server)
    still_serving(engine_server)
