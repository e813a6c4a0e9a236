"""vLLM's `stream_options.continuous_usage_stats` through the official openai client: every chunk of a
stream carries the usage so far (the router meters tenants' streams by it). The oracle is the
engine's own token ids (return_token_ids): each chunk's completion_tokens is the count of the ids
streamed so far, its prompt_tokens the prompt's ids, and the last chunk's usage the non-streamed one."""

from __future__ import annotations

from tests.data_plane.api.conftest import SERVED_NAME

CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}
IDS = {"return_token_ids": True, "ignore_eos": True}


def test_chat_chunks_carry_the_usage_so_far(openai_client):
    messages = [{"role": "user", "content": "Tell me about the sea"}]
    full = openai_client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=12,
                                                 temperature=0, extra_body=IDS)
    chunks = list(openai_client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=12,
                                                        temperature=0, stream=True, stream_options=CONTINUOUS,
                                                        extra_body=IDS))
    prompt = len(chunks[0].model_extra["prompt_token_ids"])
    assert prompt == full.usage.prompt_tokens
    seen = 0
    for chunk in chunks[:-1]:
        seen += len(chunk.choices[0].model_extra.get("token_ids") or [])
        assert chunk.usage is not None and chunk.choices
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (prompt, seen)
        assert chunk.usage.total_tokens == prompt + seen
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == seen == 12
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_completion_chunks_carry_the_usage_so_far_across_prompts(openai_client):
    prompts = ["The sea is", "A ship"]
    chunks = list(openai_client.completions.create(model=SERVED_NAME, prompt=prompts, max_tokens=5, n=2,
                                                   temperature=0, stream=True, stream_options=CONTINUOUS,
                                                   extra_body=IDS))
    full = openai_client.completions.create(model=SERVED_NAME, prompt=prompts, max_tokens=5, n=2, temperature=0,
                                            extra_body=IDS)
    seen = 0
    for chunk in chunks[:-1]:
        seen += sum(len(c.model_extra.get("token_ids") or []) for c in chunk.choices)
        assert chunk.usage.prompt_tokens == full.usage.prompt_tokens
        assert chunk.usage.completion_tokens == seen
    assert seen == full.usage.completion_tokens == 2 * 2 * 5
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_without_include_usage_continuous_stats_add_nothing(openai_client):
    chunks = list(openai_client.completions.create(model=SERVED_NAME, prompt="The sea", max_tokens=3, stream=True,
                                                   stream_options={"continuous_usage_stats": True}))
    assert chunks and all(c.usage is None and c.choices for c in chunks)
