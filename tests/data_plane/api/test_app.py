"""The HTTP layer over a real engine on the tiny demo checkpoint: response shapes, SSE framing and
error mapping. Failures are injected into that engine (tests/data_plane/api/engines.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from litestar.testing import TestClient

from data_plane.api.app import create_app
from data_plane.engine.async_engine import AsyncLLMEngine
from tests.data_plane.api.engines import (
    MAX_MODEL_LEN,
    SERVED,
    fail_batches_after,
    kill_loop_on_next_step,
    make_engine,
    refuse_admission,
    stalled,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture
def engine(demo_model_dir: Path) -> AsyncLLMEngine:
    return make_engine(demo_model_dir)


@pytest.fixture
def client(engine: AsyncLLMEngine) -> Iterator[TestClient]:
    with TestClient(create_app(engine, engine.config), raise_server_exceptions=False) as c:
        yield c


def chat_body(**fields) -> dict:
    body = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True}
    return {**body, **fields}


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


def decode(engine: AsyncLLMEngine, ids: list[int]) -> str:
    return engine.tokenizer.decode(ids, skip_special_tokens=True)


def test_engine_started_in_the_loop(client, engine):
    assert engine._thread is not None and engine._thread.is_alive()


def test_chat_completion_shape(client, engine):
    r = client.post(CHAT, json=chat_body(return_token_ids=True, temperature=0))
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == SERVED
    [choice] = body["choices"]
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert len(choice["token_ids"]) == 5
    assert choice["message"] == {"role": "assistant", "content": decode(engine, choice["token_ids"])}
    prompt = engine.tokenizer.encode(
        engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]), add_special_tokens=True
    )
    assert body["prompt_token_ids"] == prompt
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == len(prompt) + 5
    again = client.post(CHAT, json=chat_body(return_token_ids=True, temperature=0)).json()
    assert again["choices"][0]["token_ids"] == choice["token_ids"]  # greedy: the same answer


def test_chat_default_max_tokens_fills_the_context(client):
    body = chat_body()
    del body["max_tokens"]
    r = client.post(CHAT, json=body)
    assert r.status_code == 200
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == MAX_MODEL_LEN - usage["prompt_tokens"]


def test_chat_n2_and_logprobs(client, engine):
    r = client.post(CHAT, json=chat_body(n=2, logprobs=True, top_logprobs=2, temperature=0, return_token_ids=True))
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["token_ids"] == choices[1]["token_ids"]  # greedy: both samples agree
    content = choices[0]["logprobs"]["content"]
    assert len(content) == 5
    for entry, token_id in zip(content, choices[0]["token_ids"], strict=True):
        assert entry["token"] == engine.tokenizer.convert_ids_to_tokens([token_id])[0] or entry["bytes"]
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        top = entry["top_logprobs"]
        assert top[0]["logprob"] >= top[1]["logprob"]
        assert top[0]["token"] == entry["token"] and top[0]["logprob"] == entry["logprob"]  # greedy = the best
    assert bytes(sum((e["bytes"] for e in content), [])).decode() == choices[0]["message"]["content"]


def test_chat_stream(client):
    r = client.post(CHAT, json=chat_body(n=2, stream=True, stream_options={"include_usage": True}, temperature=0))
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == SERVED for c in chunks)
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
    assert finish == {0: "length", 1: "length"}
    whole = client.post(CHAT, json=chat_body(temperature=0)).json()["choices"][0]["message"]["content"]
    assert texts == {0: whole, 1: whole}  # the stream's pieces add up to the non-streamed answer
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10


def test_completion_shape_echo_and_batch(client, engine):
    r = client.post(
        COMPLETIONS,
        json={"model": SERVED, "prompt": ["ab", "cd"], "max_tokens": 3, "n": 2, "echo": True, "temperature": 0},
    )
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in body["choices"]]
    for prompt, text in zip(["ab", "ab", "cd", "cd"], texts, strict=True):
        alone = client.post(COMPLETIONS, json={"model": SERVED, "prompt": prompt, "max_tokens": 3, "temperature": 0})
        assert text == prompt + alone.json()["choices"][0]["text"]  # echo, then the same greedy answer
    prompt_tokens = sum(len(engine.tokenizer.encode(p, add_special_tokens=True)) for p in ("ab", "cd"))
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 12,
        "total_tokens": prompt_tokens + 12,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_completion_legacy_logprobs_and_token_ids(client, engine):
    r = client.post(
        COMPLETIONS,
        json={
            "model": SERVED,
            "prompt": [104, 105],
            "max_tokens": 3,
            "logprobs": 1,
            "return_token_ids": True,
            "temperature": 0,
        },
    )
    [choice] = r.json()["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == 3 and all(v <= 0 for v in lp["token_logprobs"])
    assert lp["text_offset"][0] == 0
    assert [len(t) for t in lp["top_logprobs"]] == [1, 1, 1]
    assert lp["top_logprobs"][0] == {lp["tokens"][0]: lp["token_logprobs"][0]}  # greedy: the best is the pick
    assert choice["prompt_token_ids"] == [104, 105] and len(choice["token_ids"]) == 3
    assert choice["text"] == decode(engine, choice["token_ids"])


def test_completion_stream(client):
    body = {"model": SERVED, "prompt": "x", "max_tokens": 4, "temperature": 0}
    events = sse_events(client.post(COMPLETIONS, json={**body, "stream": True, "logprobs": 0}).text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == client.post(COMPLETIONS, json=body).json()["choices"][0]["text"]
    offsets = [c["choices"][0]["logprobs"]["text_offset"] for c in chunks]
    assert offsets[0] == [0] and all(len(o) == 1 for o in offsets) and len(offsets) == 4
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in chunks[0]


def test_models_health_version_metrics(client, engine):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    [card] = models["data"]
    assert card["id"] == SERVED and card["object"] == "model" and card["owned_by"] == "loraplane"
    assert card["max_model_len"] == MAX_MODEL_LEN and card["parent"] is None and card["root"] == engine.config.model
    assert client.get(f"/v1/models/{SERVED}").json() == card
    assert_openai_error(client.get("/v1/models/other"), 404, "not_found_error")
    assert client.get("/health").status_code == 200
    assert client.get("/version").json()["version"]
    client.post(CHAT, json=chat_body())
    metrics = client.get("/metrics").text
    assert f'loraplane_requests_total{{adapter="{SERVED}",outcome="ok"}} 1.0' in metrics
    assert f'loraplane_generation_tokens_total{{adapter="{SERVED}"}} 5.0' in metrics
    assert "loraplane_kv_blocks_total 64.0" in metrics
    assert f'loraplane_time_to_first_token_seconds_count{{adapter="{SERVED}"}} 1.0' in metrics


def test_health_503_when_engine_dead(client, engine, monkeypatch):
    kill_loop_on_next_step(engine, monkeypatch, "CUDA error")
    assert_openai_error(client.post(CHAT, json=chat_body()), 503, "engine_dead")
    error = assert_openai_error(client.get("/health"), 503, "engine_dead")
    assert "CUDA error" in error["message"]
    assert_openai_error(client.post(CHAT, json=chat_body()), 503, "engine_dead")  # and it stays dead


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
        # fits alone, not with the prompt: the engine's check (the prompt fits, so max_tokens is the culprit)
        (chat_body(max_tokens=60), "max_tokens"),
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
    assert engine.stats().kv_blocks_used == 0 and not engine.engine.has_work()  # never a fallback to the base
    metrics = client.get("/metrics").text
    assert 'loraplane_requests_total{adapter="",outcome="rejected"} 1.0' in metrics
    assert f'loraplane_prompt_tokens_total{{adapter="{SERVED}"}}' not in metrics
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


def test_overloaded_is_503_and_a_batch_that_never_fits_is_400(demo_model_dir, monkeypatch):
    """Slow steps and room for two waiting sequences, one taken: a batch of two prompts would fit, but not
    now, so it is refused whole with 503, streamed or not; a batch of three never fits (400)."""
    engine = make_engine(demo_model_dir, max_waiting_requests=2, max_n=1)
    with TestClient(create_app(engine, engine.config), raise_server_exceptions=False) as client:
        batch = {"model": SERVED, "prompt": ["x", "y"], "max_tokens": 2}
        with stalled(engine, monkeypatch, step_s=0.2), ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.post, COMPLETIONS, json={"model": SERVED, "prompt": "z", "max_tokens": 2})
            deadline = time.monotonic() + 30
            while engine.num_requests() == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            error = assert_openai_error(client.post(COMPLETIONS, json=batch), 503, "service_unavailable")
            assert "2 prompts × n=1 = 2 sequences" in error["message"]
            assert_openai_error(client.post(COMPLETIONS, json={**batch, "stream": True}), 503)
            error = assert_openai_error(client.post(COMPLETIONS, json={**batch, "prompt": ["x", "y", "z"]}), 400)
            assert "(--max-waiting-requests)" in error["message"] and error["param"] == "prompt"
            assert first.result().status_code == 200
        ok(client)
        metrics = client.get("/metrics").text
        assert f'loraplane_requests_total{{adapter="{SERVED}",outcome="rejected"}} 7.0' in metrics


def test_unexpected_exception_is_500_without_internals(client, engine, monkeypatch):
    refuse_admission(engine, monkeypatch, RuntimeError("secret path /etc/passwd"))
    error = assert_openai_error(client.post(CHAT, json=chat_body()), 500, "internal_error")
    assert "secret" not in error["message"] and "RuntimeError" not in error["message"]
    monkeypatch.undo()
    ok(client)


def test_engine_failure_non_streaming_is_500_and_streaming_is_an_error_event(client, engine, monkeypatch):
    fail_batches_after(engine, monkeypatch, 2)  # two tokens, then the batch fails in the model
    error = assert_openai_error(client.post(CHAT, json=chat_body()), 500)
    assert "boom" not in error["message"]  # the engine's own message stays in the server log
    events = sse_events(client.post(CHAT, json=chat_body(stream=True)).text)
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "internal_error"
    monkeypatch.undo()
    ok(client)
    assert f'loraplane_requests_total{{adapter="{SERVED}",outcome="error"}} 2.0' in client.get("/metrics").text
