"""Prompts are tokenized off the event loop: while one is being encoded, /health still answers.

The tokenizer here blocks until the test has had /health answered; run on the event loop, it
would block that very loop, /health could not answer, and the tokenizer's wait would time out.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from data_plane.api.app import create_app
from data_plane.engine.async_engine import AsyncLLMEngine
from data_plane.tokenizer import Tokenizer
from tests.data_plane.api.engines import SERVED, make_engine

WAIT_S = 20  # generous: the test releases the tokenizer as soon as /health has answered


class BlockingTokenizer(Tokenizer):
    """The engine's tokenizer, blocking on texts that start with "block" until released."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.released_in_time: bool | None = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if text.startswith("block"):
            self.entered.set()
            self.released_in_time = self.release.wait(WAIT_S)
        return super().encode(text, add_special_tokens)


def engine_with(demo_model_dir, tokenizer: BlockingTokenizer) -> AsyncLLMEngine:
    engine = make_engine(demo_model_dir)
    engine.tokenizer = tokenizer  # what the API encodes with; the engine's own detokenizer is untouched
    return engine


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": SERVED, "prompt": "block me", "max_tokens": 2}),
        ("/v1/chat/completions", {"model": SERVED, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
    ],
)
async def test_health_answers_while_a_prompt_is_being_tokenized(demo_model_dir, path, body):
    tokenizer = BlockingTokenizer.from_pretrained(demo_model_dir)
    if path.endswith("chat/completions"):  # the rendered chat prompt starts with the role
        tokenizer.apply_chat_template = lambda messages, add_generation_prompt=True, **_: "block " + messages[0]["content"]
    engine = engine_with(demo_model_dir, tokenizer)
    app = create_app(engine, engine.config)
    transport = httpx.ASGITransport(app=app)  # the app runs on this test's event loop
    async with app.lifespan(), httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
        work = asyncio.ensure_future(client.post(path, json=body))
        assert await asyncio.to_thread(tokenizer.entered.wait, WAIT_S)
        health = await client.get("/health")
        assert health.status_code == 200 and not work.done()
        tokenizer.release.set()
        response = await work
    assert tokenizer.released_in_time is True
    assert response.status_code == 200, response.text


def test_a_prompt_over_the_character_limit_is_refused_before_tokenizing(demo_model_dir):
    from litestar.testing import TestClient

    tokenizer = BlockingTokenizer.from_pretrained(demo_model_dir)  # would block (and time out) if asked to encode
    engine = engine_with(demo_model_dir, tokenizer)
    config = engine.config
    with TestClient(create_app(engine, config)) as client:
        body = {"model": SERVED, "prompt": "block" + "x" * config.max_prompt_chars, "max_tokens": 2}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "prompt" and "characters" in error["message"]
        messages = [{"role": "user", "content": "y" * (config.max_prompt_chars // 2)}] * 3
        r = client.post("/v1/chat/completions", json={"model": SERVED, "messages": messages})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert not tokenizer.entered.is_set()
