"""The HTTP layer over a scripted engine: response shapes, SSE framing and error mapping."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from litestar.testing import TestClient

from data_plane.api.app import create_app
from tests.data_plane.api.fakes import FakeConfig, FakeEngine

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(create_app(engine, FakeConfig()), raise_server_exceptions=False) as c:
        yield c


def chat_body(**fields) -> dict:
    return {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **fields}


def sse_events(text: str) -> list:
    """Parse an SSE body; every event must be `data: ...` followed by a blank line."""
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def assert_openai_error(response, status: int, error_type: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if error_type:
        assert error["type"] == error_type
    return error


def test_engine_started_in_the_loop(client, engine):
    assert engine.started


def test_chat_completion_shape(client, engine):
    r = client.post(CHAT, json=chat_body(return_token_ids=True))
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == "fake"
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "hello"}
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert choice["token_ids"] == [ord(c) for c in "hello"]
    prompt = engine.tokenizer.encode(
        engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    )
    assert body["prompt_token_ids"] == prompt
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == len(prompt) + 5
    assert engine.requests[0].request_id == body["id"]


def test_chat_default_max_tokens_fills_the_context(client, engine):
    body = chat_body()
    del body["max_tokens"]
    r = client.post(CHAT, json=body)
    assert r.status_code == 200
    prompt_len = r.json()["usage"]["prompt_tokens"]
    assert engine.requests[0].sampling_params.max_tokens == engine.config.max_model_len - prompt_len


def test_chat_n2_and_logprobs(client):
    r = client.post(CHAT, json=chat_body(n=2, logprobs=True, top_logprobs=2))
    choices = r.json()["choices"]
    assert [c["message"]["content"] for c in choices] == ["hello", "ifmmp"]
    content = choices[0]["logprobs"]["content"]
    assert [e["token"] for e in content] == list("hello")
    assert content[0]["logprob"] == -0.5 and content[0]["bytes"] == [ord("h")]
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["h", "?"]


def test_chat_stream(client):
    r = client.post(CHAT, json=chat_body(n=2, stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "fake" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    # first chunk of each choice carries the role
    assert [c["choices"][0]["delta"].get("role") for c in chunks[:2]] == ["assistant", "assistant"]
    texts = {0: "", 1: ""}
    finish = {}
    for c in chunks[:-1]:
        assert c["usage"] is None
        [choice] = c["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "hello", 1: "ifmmp"} and finish == {0: "length", 1: "length"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10


def test_completion_shape_echo_and_batch(client, engine):
    r = client.post(
        COMPLETIONS, json={"model": "fake", "prompt": ["ab", "cd"], "max_tokens": 3, "n": 2, "echo": True}
    )
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["abhel", "abifm", "cdhel", "cdifm"]
    assert body["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 12,
        "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert len(engine.requests) == 2


def test_completion_legacy_logprobs_and_token_ids(client):
    r = client.post(
        COMPLETIONS,
        json={
            "model": "fake",
            "prompt": [104, 105],
            "max_tokens": 3,
            "logprobs": 1,
            "return_token_ids": True,
        },
    )
    [choice] = r.json()["choices"]
    lp = choice["logprobs"]
    assert lp["tokens"] == ["h", "e", "l"] and lp["token_logprobs"] == [-0.5, -0.5, -0.5]
    assert lp["text_offset"] == [0, 1, 2]
    assert lp["top_logprobs"][0] == {"h": -0.5, "?": -1.5, "!": -2.5}
    assert choice["prompt_token_ids"] == [104, 105] and choice["token_ids"] == [104, 101, 108]


def test_completion_stream(client):
    r = client.post(
        COMPLETIONS, json={"model": "fake", "prompt": "x", "max_tokens": 4, "stream": True, "logprobs": 0}
    )
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hell"
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks] == [[0], [1], [2], [3]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in chunks[0]


def test_models_health_version_metrics(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    [card] = models["data"]
    assert card["id"] == "fake" and card["object"] == "model" and card["owned_by"] == "loraplane"
    assert card["max_model_len"] == 64 and card["parent"] is None and card["root"] == "/models/fake"
    assert client.get("/v1/models/fake").json() == card
    assert_openai_error(client.get("/v1/models/other"), 404, "not_found_error")
    assert client.get("/health").status_code == 200
    assert client.get("/version").json()["version"]
    client.post(CHAT, json=chat_body())
    metrics = client.get("/metrics").text
    assert 'loraplane_requests_total{adapter="fake",outcome="ok"} 1.0' in metrics
    assert 'loraplane_generation_tokens_total{adapter="fake"} 5.0' in metrics
    assert "loraplane_kv_blocks_total 8.0" in metrics
    assert 'loraplane_time_to_first_token_seconds_count{adapter="fake"} 1.0' in metrics


def test_health_503_when_engine_dead(client, engine):
    engine.healthy, engine.dead_reason = False, "CUDA error"
    error = assert_openai_error(client.get("/health"), 503, "engine_dead")
    assert "CUDA error" in error["message"]


# ---- errors: each is an OpenAI body, and the server keeps serving ------------------------------


def ok(client) -> None:
    assert client.post(CHAT, json=chat_body()).status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat_body(messages=[]), "messages"),
        (chat_body(max_tokens=-1), "max_tokens"),
        (chat_body(temperature=-1), "temperature"),
        (chat_body(max_tokens="5"), "max_tokens"),
        (chat_body(max_tokens=1000), "max_tokens"),  # over max_model_len: the schema's range
        (chat_body(max_tokens=60), "prompt"),  # fits alone, not with the prompt: the engine's check
    ],
)
def test_invalid_requests_are_400(client, body, param):
    error = assert_openai_error(client.post(CHAT, json=body), 400, "invalid_request_error")
    assert error["param"] == param
    ok(client)


def test_malformed_json_is_400(client):
    assert_openai_error(
        client.post(CHAT, content=b'{"model": ', headers={"content-type": "application/json"}), 400
    )
    ok(client)


def test_unknown_model_is_404(client, engine):
    error = assert_openai_error(client.post(CHAT, json=chat_body(model="gpt-4")), 404, "not_found_error")
    assert error["message"] == "The model `gpt-4` does not exist." and error["param"] == "model"
    assert engine.requests == []  # never a fallback to the base model
    ok(client)


def test_oversized_body_is_413(client):
    big = chat_body(messages=[{"role": "user", "content": "x" * 5000}])
    error = assert_openai_error(client.post(CHAT, json=big), 413)
    assert "4096" in error["message"]
    ok(client)


def test_unknown_route_404_and_wrong_method_405(client):
    assert_openai_error(client.post("/v1/nope", json={}), 404, "not_found_error")
    assert_openai_error(client.get(CHAT), 405)
    ok(client)


def test_overloaded_is_503(client, engine):
    engine.overloaded = True
    assert_openai_error(client.post(CHAT, json=chat_body()), 503, "service_unavailable")
    assert_openai_error(client.post(COMPLETIONS, json={"model": "fake", "prompt": "x", "stream": True}), 503)
    engine.overloaded = False
    ok(client)
    assert 'loraplane_requests_total{adapter="fake",outcome="rejected"} 2.0' in client.get("/metrics").text


def test_unexpected_exception_is_500_without_internals(client, engine):
    engine.fail_with = RuntimeError("secret path /etc/passwd")
    error = assert_openai_error(client.post(CHAT, json=chat_body()), 500, "internal_error")
    assert "secret" not in error["message"] and "RuntimeError" not in error["message"]
    engine.fail_with = None
    ok(client)


def test_engine_failure_non_streaming_is_500_and_streaming_is_an_error_event(client, engine):
    engine.error_after = 2
    error = assert_openai_error(client.post(CHAT, json=chat_body()), 500)
    assert "boom" not in error["message"]  # the engine's own message stays in the server log
    events = sse_events(client.post(CHAT, json=chat_body(stream=True)).text)
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "internal_error"
    engine.error_after = None
    ok(client)
    assert 'loraplane_requests_total{adapter="fake",outcome="error"} 2.0' in client.get("/metrics").text
