"""The official `openai` client against a real engine process (demo model, CPU)."""

from __future__ import annotations

import pytest

from tests.data_plane.api.conftest import SERVED_NAME

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about the sea."},
]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def chat(client, **kw):
    return client.chat.completions.create(model=SERVED_NAME, messages=kw.pop("messages", MESSAGES), **kw)


def test_models_list(openai_client):
    [model] = openai_client.models.list().data
    assert model.id == SERVED_NAME and model.owned_by == "loraplane"
    assert model.model_extra["max_model_len"] == 256
    assert openai_client.models.retrieve(SERVED_NAME).id == SERVED_NAME


def test_chat_completion(openai_client):
    r = chat(openai_client, max_tokens=12, **GREEDY)
    assert r.id.startswith("chatcmpl-") and r.model == SERVED_NAME and r.object == "chat.completion"
    [choice] = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_stream_matches_non_streaming_and_reports_usage(openai_client):
    full = chat(openai_client, max_tokens=16, **GREEDY)
    chunks = list(
        chat(openai_client, max_tokens=16, stream=True, stream_options={"include_usage": True}, **GREEDY)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content  # greedy: same text either way
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_n2(openai_client):
    sampled = {"temperature": 1.0, "seed": 7, "extra_body": {"ignore_eos": True}}
    r = chat(openai_client, max_tokens=8, n=2, **sampled)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 16
    stream = list(chat(openai_client, max_tokens=8, n=2, stream=True, **sampled))
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    # a seeded request samples the same tokens again
    assert texts == {c.index: c.message.content for c in r.choices}


def test_stop_strings(openai_client):
    text = chat(openai_client, max_tokens=24, **GREEDY).choices[0].message.content
    stop = text[8:11]
    expected = text[: text.index(stop)]
    r = chat(openai_client, max_tokens=24, stop=[stop], **GREEDY)
    [choice] = r.choices
    assert choice.message.content == expected
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    kept = chat(
        openai_client,
        max_tokens=24,
        stop=stop,
        temperature=0.0,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )
    assert kept.choices[0].message.content == expected + stop
    streamed = chat(openai_client, max_tokens=24, stop=[stop], stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected


def test_return_token_ids(openai_client):
    r = chat(openai_client, max_tokens=6, temperature=0.0, extra_body={"return_token_ids": True})
    assert len(r.model_extra["prompt_token_ids"]) == r.usage.prompt_tokens
    assert len(r.choices[0].model_extra["token_ids"]) == r.usage.completion_tokens


def test_chat_logprobs(openai_client):
    r = chat(openai_client, max_tokens=6, logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        lps = [t.logprob for t in entry.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert entry.logprob == pytest.approx(lps[0])  # greedy picks the most likely token
        assert entry.bytes == list(entry.token.encode())


def test_completions(openai_client):
    r = openai_client.completions.create(
        model=SERVED_NAME, prompt="The sea is", max_tokens=10, temperature=0.0
    )
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    [choice] = r.choices
    assert choice.text and choice.finish_reason in ("length", "stop")
    streamed = openai_client.completions.create(
        model=SERVED_NAME,
        prompt="The sea is",
        max_tokens=10,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_completions_default_max_tokens_is_16(openai_client):
    r = openai_client.completions.create(
        model=SERVED_NAME, prompt="The sea", temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 16


def test_completion_token_prompt_batch_and_echo(openai_client):
    by_ids = openai_client.completions.create(
        model=SERVED_NAME,
        prompt=[10, 20, 30],
        max_tokens=4,
        temperature=0.0,
        extra_body={"return_token_ids": True},
    )
    assert by_ids.choices[0].model_extra["prompt_token_ids"] == [10, 20, 30]
    batch = openai_client.completions.create(
        model=SERVED_NAME, prompt=["The sea", "A ship"], max_tokens=4, n=2, temperature=0.0, echo=True
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    prompts = ["The sea", "The sea", "A ship", "A ship"]
    assert all(
        c.text.startswith(p) and len(c.text) > len(p) for c, p in zip(batch.choices, prompts, strict=True)
    )
    assert batch.choices[0].text == batch.choices[1].text  # greedy: both samples agree


def test_completion_logprobs_legacy_format(openai_client):
    r = openai_client.completions.create(
        model=SERVED_NAME,
        prompt="The sea is",
        max_tokens=5,
        temperature=0.0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == pytest.approx(logprob) and len(top) >= 2
        assert logprob == pytest.approx(max(top.values()))
