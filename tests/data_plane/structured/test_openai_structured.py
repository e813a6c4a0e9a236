"""Structured outputs through a real `loraplane engine` (engine-core process, demo model and an adapter, CPU),
spoken to by the official `openai` client: response_format (a pydantic model through `parse`, json_schema,
json_object), vLLM's structured_outputs (regex, choice, grammar), streamed and not; the 400s of a constraint
that cannot be used, a grammar's dead end, and the compile cache's metrics. The weights are random: only the
grammar makes the answers valid, so every schema here bounds its output below max_tokens."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

import httpx
import pytest
from pydantic import BaseModel, Field

from data_plane.demo.adapters import write_demo_adapters
from data_plane.tokenizer import Tokenizer
from tests.data_plane.api.conftest import SHARED_FLAGS, EngineServer, run_engine
from tests.data_plane.structured.oracle import DEAD_END

openai = pytest.importorskip("openai")

MAX_STRUCTURED_BYTES = 4096
MESSAGES = [{"role": "user", "content": "Describe a pet."}]
GREEDY = {"temperature": 0.0, "max_tokens": 120}


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    name: Annotated[str, Field(pattern="^[a-z]{1,6}$")]
    tags: Annotated[list[Literal["old", "new"]], Field(max_length=2)]


PET_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema(), "strict": True}}


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    root = tmp_path_factory.mktemp("structured")
    pirate = write_demo_adapters(demo_model_dir, root / "adapters", names=["demo-pirate"])["demo-pirate"]
    flags = [*SHARED_FLAGS, "--enable-lora", "--max-loras", "2", "--lora-modules", f"demo-pirate={pirate}",
             "--max-structured-output-bytes", str(MAX_STRUCTURED_BYTES)]
    with run_engine(demo_model_dir, root / "engine.log", *flags) as engine:
        yield engine


@pytest.fixture(scope="module")
def client(server: EngineServer):
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)


def streamed_chat(client, **fields) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in client.chat.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_parse_returns_the_pydantic_object_on_the_base_model_and_an_adapter(client):
    for model in ("demo", "demo-pirate"):
        completion = client.chat.completions.parse(model=model, messages=MESSAGES, response_format=Pet, **GREEDY)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet)
        assert choice.message.content == choice.message.parsed.model_dump_json()  # compact: no free whitespace


def test_json_schema_streamed_equals_the_whole_answer_and_validates(client):
    fields = {"model": "demo", "messages": MESSAGES, "response_format": PET_FORMAT, **GREEDY}
    whole = client.chat.completions.create(**fields).choices[0]
    text, finish = streamed_chat(client, **fields)
    assert (text, finish) == (whole.message.content, whole.finish_reason) == (text, "stop")
    Pet.model_validate_json(text)


def test_a_constrained_answer_cut_by_max_tokens_finishes_with_length(client):
    """Cut short, the answer is the start of the whole one, unfinished (it does not parse), as OpenAI's."""
    fields = {"model": "demo", "messages": MESSAGES, "response_format": PET_FORMAT, "temperature": 0.0}
    whole = client.chat.completions.create(**fields, max_tokens=GREEDY["max_tokens"]).choices[0].message.content
    cut = client.chat.completions.create(**fields, max_tokens=3).choices[0]
    assert cut.finish_reason == "length" and whole.startswith(cut.message.content) and cut.message.content != whole
    with pytest.raises(ValueError):
        Pet.model_validate_json(cut.message.content)
    assert streamed_chat(client, **fields, max_tokens=3) == (cut.message.content, "length")


def test_json_object_is_masked_before_the_logit_bias_on_chat_and_completions(client, demo_model_dir):
    """Any JSON object is unbounded, so a bias steers it: "}" favoured (unconstrained, every token would be
    "}"), '{"' shunned. The mask comes first, so the answer opens with "{" and closes at once."""
    tokenizer = Tokenizer.from_pretrained(demo_model_dir)
    bias = {str(tokenizer.token_to_id("}")): 100, str(tokenizer.token_to_id('{"')): -100}
    fields = {**GREEDY, "logit_bias": bias}
    chat = client.chat.completions.create(
        model="demo", messages=MESSAGES, response_format={"type": "json_object"}, **fields
    ).choices[0]
    completion = client.completions.create(
        model="demo", prompt="Hi", **fields, extra_body={"response_format": {"type": "json_object"}}
    ).choices[0]
    assert (chat.message.content, chat.finish_reason) == ("{}", "stop")
    assert (completion.text, completion.finish_reason) == ("{}", "stop")
    plain = client.completions.create(model="demo", prompt="Hi", temperature=0.0, max_tokens=3, logit_bias=bias)
    assert plain.choices[0].text == "}}}"


def test_regex_on_completions_streamed_and_not(client):
    regex = "(yes|no)-[0-9]{3}"
    fields = {"model": "demo", "prompt": "Answer:", **GREEDY, "extra_body": {"structured_outputs": {"regex": regex}}}
    whole = client.completions.create(**fields).choices[0]
    streamed = list(client.completions.create(**fields, stream=True))
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert re.fullmatch(regex, whole.text) and whole.finish_reason == "stop"
    assert text == whole.text and streamed[-1].choices[0].finish_reason == "stop"


def test_choice_and_grammar_on_chat(client):
    choice = client.chat.completions.create(
        model="demo-pirate", messages=MESSAGES, **GREEDY,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    ).choices[0]
    assert choice.message.content in {"red", "green", "blue"} and choice.finish_reason == "stop"
    lark = 'start: greeting " " name\ngreeting: "hi" | "hello"\nname: /[a-z]{2,5}/'
    text, finish = streamed_chat(client, model="demo", messages=MESSAGES, **GREEDY,
                                 extra_body={"structured_outputs": {"grammar": lark}})
    assert re.fullmatch("(hi|hello) [a-z]{2,5}", text) and finish == "stop"


def bad_request(server: EngineServer, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json={"model": "demo", **GREEDY, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    return error


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": {
        "type": "object", "description": "x" * MAX_STRUCTURED_BYTES}}}}, "response_format",
     "--max-structured-output-bytes"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs", "missing_rule"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "not valid"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs", "not both"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
])
def test_a_constraint_that_cannot_be_used_is_a_400_naming_the_field(server, body, param, words):
    for path, shape in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "Hi"})):
        error = bad_request(server, path, {**shape, **body})
        assert error["param"] == param and words in error["message"], error


def test_a_dead_end_fails_the_request_and_the_engine_serves_on(server, client):
    body = {"model": "demo", "prompt": "Hi", **GREEDY, "structured_outputs": {"grammar": DEAD_END}}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "structured_output_dead_end", r.text
    # streamed: its first token went out, so the dead end is the stream's error event
    streamed = httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
    events = [line.removeprefix("data: ") for line in streamed.text.split("\n\n") if line]
    assert streamed.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    assert json.loads(events[-2])["error"]["code"] == "structured_output_dead_end"
    assert client.completions.create(model="demo", prompt="Hi", max_tokens=4).choices[0].finish_reason == "length"


def test_the_compile_cache_counts_hits_and_misses(server, client):
    regex = "(maybe|perhaps)"
    fields = {"model": "demo", "prompt": "Hi", **GREEDY, "extra_body": {"structured_outputs": {"regex": regex}}}
    misses = server.metric("loraplane_structured_output_cache_misses_total")
    hits = server.metric("loraplane_structured_output_cache_hits_total")
    client.completions.create(**fields)
    client.completions.create(**fields)
    assert server.metric("loraplane_structured_output_cache_misses_total") == misses + 1
    assert server.metric("loraplane_structured_output_cache_hits_total") == hits + 1
