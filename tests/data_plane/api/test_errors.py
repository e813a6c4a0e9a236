"""Errors from a real engine process: OpenAI-shaped bodies, right statuses, and the server keeps serving."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.data_plane.api.conftest import SERVED_NAME, EngineServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_body(**fields) -> dict:
    return {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        **fields,
    }


def openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def still_serving(server: EngineServer) -> None:
    r = httpx.post(server.url + CHAT, json=chat_body(), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat_body(messages=[]), "messages"),
        (chat_body(max_tokens=-3), "max_tokens"),
        (chat_body(temperature=-0.1), "temperature"),
        (chat_body(max_tokens="four"), "max_tokens"),
        (chat_body(messages=[{"role": "user", "content": "word " * 400}]), "prompt"),  # prompt too long
        (chat_body(max_tokens=1000), "max_tokens"),  # prompt + max_tokens over max_model_len
    ],
)
def test_bad_requests_are_400(engine_server, body, param):
    error = openai_error(httpx.post(engine_server.url + CHAT, json=body, timeout=60), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param
    still_serving(engine_server)


def test_prompt_too_long_names_the_context_length(engine_server):
    body = {"model": SERVED_NAME, "prompt": [5] * 300, "max_tokens": 1}
    error = openai_error(httpx.post(engine_server.url + COMPLETIONS, json=body, timeout=60), 400)
    assert error["code"] == "context_length_exceeded" and "256" in error["message"]
    still_serving(engine_server)


def test_malformed_json_is_400(engine_server):
    r = httpx.post(
        engine_server.url + CHAT,
        content=b'{"model": "demo", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert openai_error(r, 400)["type"] == "invalid_request_error"
    still_serving(engine_server)


def test_unknown_model_is_404_also_for_the_openai_client(engine_server, openai_client):
    error = openai_error(httpx.post(engine_server.url + CHAT, json=chat_body(model="no-such-model")), 404)
    assert error["message"] == "The model `no-such-model` does not exist."
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.NotFoundError):
        openai_client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    still_serving(engine_server)


def test_oversized_body_is_413(engine_server):
    big = chat_body(messages=[{"role": "user", "content": "x" * 300_000}])  # limit: 262144 bytes
    error = openai_error(httpx.post(engine_server.url + CHAT, json=big, timeout=60), 413)
    assert "262144" in error["message"]
    still_serving(engine_server)


def test_unknown_route_is_404(engine_server):
    assert (
        openai_error(httpx.post(engine_server.url + "/v1/embeddings", json={}), 404)["type"]
        == "not_found_error"
    )
    assert openai_error(httpx.get(engine_server.url + "/nothing/here"), 404)
    still_serving(engine_server)


def test_full_waiting_queue_is_503(start_engine):
    server = start_engine("--max-num-seqs", "1", "--max-waiting-requests", "1", "--max-model-len", "512")

    async def flood() -> list[httpx.Response]:
        body = chat_body(max_tokens=64, ignore_eos=True)
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(client.post(CHAT, json=body) for _ in range(12)))

    responses = asyncio.run(flood())
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 503}, statuses
    rejected = [openai_error(r, 503) for r in responses if r.status_code == 503]
    assert all(e["type"] == "service_unavailable" for e in rejected)
    assert server.metric("loraplane_requests_total", 'outcome="rejected"') == len(rejected)
    still_serving(server)
