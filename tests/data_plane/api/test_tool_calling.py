"""Tool calling through a real `loraplane engine` (demo model, random weights, CPU) and the official openai
client. The prompt of a tool round trip (call, tool result, answer) is checked token for token against
transformers' apply_chat_template on the same checkpoint. A random model never writes a call by itself, so
`auto`'s parsing is tested on fixed texts (test_tool_parsers.py); `required` and named choices get valid
calls from the grammar alone, with parameter schemas that bound the output (enums, maxLength) and
max_tokens above that bound.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.data_plane.api.conftest import SERVED_NAME, EngineServer, run_engine

openai = pytest.importorskip("openai")

# the tools' system prompt needs more context than the shared servers' 256 tokens
FLAGS = ["--max-model-len", "1024", "--num-kv-blocks", "192", "--max-request-body-bytes", "262144",
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 6}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
QUESTION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]
CALL = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
ROUND_TRIP = [
    *QUESTION,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature": 21}'},
]
GREEDY: dict[str, Any] = {"temperature": 0.0}
# a bound on the constrained output: one call of either tool is under 80 characters, and no token is
# shorter than one character (the grammar's whitespace aside)
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    log = tmp_path_factory.mktemp("tool_calling") / "engine.log"
    with run_engine(demo_model_dir, log, *FLAGS) as engine:
        yield engine


@pytest.fixture(scope="module")
def client(server: EngineServer):
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)


def transformers_prompt(model_dir: Path, messages: list[dict], tools: list[dict]) -> list[int]:
    """The oracle: transformers' rendering and tokenizing, with call arguments as objects (its convention)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf_messages = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        hf_messages.append(m)
    text = tok.apply_chat_template(hf_messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def test_a_tool_round_trip_prompt_is_transformers_template_streamed_or_not(client, demo_model_dir):
    expected = transformers_prompt(demo_model_dir, ROUND_TRIP, TOOLS)
    r = client.chat.completions.create(
        model=SERVED_NAME, messages=ROUND_TRIP, tools=TOOLS, tool_choice="none", max_tokens=4, **GREEDY,
        extra_body={"return_token_ids": True},
    )
    assert r.model_extra["prompt_token_ids"] == expected
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("length", "stop")
    chunks = list(client.chat.completions.create(
        model=SERVED_NAME, messages=ROUND_TRIP, tools=TOOLS, max_tokens=4, stream=True, **GREEDY,  # auto
        extra_body={"return_token_ids": True},
    ))
    assert chunks[0].model_extra["prompt_token_ids"] == expected
    # the random model writes no call: its text is the content, as without tools
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
        ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{"}}]}]},
         "messages[2].tool_calls[0].function.arguments"),
        # a parameters schema the grammar library refuses, for a choice it has to enforce
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
          "tool_choice": "required"}, "tools"),
    ],
)
def test_bad_tool_fields_are_400s_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=SERVED_NAME, **{"messages": QUESTION, "max_tokens": 2, **fields})
    assert err.value.status_code == 400 and err.value.body["param"] == param


def check_call(call, tools: list[dict]) -> dict:
    """A call's name is one of the tools' and its arguments are valid against that tool's parameters."""
    jsonschema = pytest.importorskip("jsonschema")
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in by_name
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, by_name[call.function.name])
    return arguments


def test_required_makes_one_valid_call_and_the_round_trip_continues(client, demo_model_dir):
    common = {"model": SERVED_NAME, "tools": TOOLS, "tool_choice": "required", "max_tokens": MAX_TOKENS, **GREEDY}
    r = client.chat.completions.create(messages=QUESTION, parallel_tool_calls=False, **common)
    [choice] = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    check_call(call, TOOLS)
    # streamed, the SDK's helper assembles the same call (greedy: the same output)
    with client.chat.completions.stream(messages=QUESTION, parallel_tool_calls=False, **common) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    [streamed] = final.choices[0].message.tool_calls
    assert (streamed.function.name, json.loads(streamed.function.arguments)) == (
        call.function.name, json.loads(call.function.arguments))
    # the call goes back with its result; the prompt is transformers' rendering of that conversation
    result = {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"}
    messages = [*QUESTION, choice.message.model_dump(exclude_none=True), result]
    answer = client.chat.completions.create(
        model=SERVED_NAME, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4, **GREEDY,
        extra_body={"return_token_ids": True},
    )
    assert answer.model_extra["prompt_token_ids"] == transformers_prompt(demo_model_dir, messages, TOOLS)


def test_a_named_choice_writes_that_functions_arguments_streamed_or_not(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    common = {"model": SERVED_NAME, "messages": QUESTION, "tools": TOOLS, "tool_choice": named,
              "max_tokens": MAX_TOKENS, **GREEDY}
    r = client.chat.completions.create(**common)
    [choice] = r.choices
    assert choice.finish_reason == "stop"  # OpenAI's for a named choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time"
    check_call(call, TOOLS)
    chunks = list(client.chat.completions.create(stream=True, **common))
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "get_time"
    assert pieces[0].function.arguments == "" and all(p.index == 0 and p.id is None for p in pieces[1:])
    assert "".join(p.function.arguments for p in pieces[1:]) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
