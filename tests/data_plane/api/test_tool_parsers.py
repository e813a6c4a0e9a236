"""Tool calls read out of fixed model texts, whole and streamed, and the request's tool fields checked.

The parsers are pure functions of the text: each case is parsed whole and fed in pieces (one character at a
time, and in pieces of 5), and both give the same content and calls. The stream deltas are assembled by the
openai SDK's own accumulator (the one behind `client.chat.completions.stream`) into the same message.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import jsonschema
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from data_plane import config
from data_plane.api.protocol import ChatCompletionRequest, decode_request
from data_plane.api.tool_calls import ChoiceCalls, ToolPlan, deltas, message, required_schema
from data_plane.api.tool_parsers import (
    TOOL_CALL_PARSERS,
    NamedParser,
    ParsedCall,
    ParsedOutput,
    ToolParser,
    collect,
    parse,
    required_parser,
)
from data_plane.engine.sampling_params import SamplingParams
from shared.errors import InvalidRequestError

HERMES = TOOL_CALL_PARSERS["hermes"]
LLAMA = TOOL_CALL_PARSERS["llama3_json"]
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "UTC"}}'


def calls(*pairs: tuple[str, dict]) -> list[ParsedCall]:
    return [ParsedCall(name, json.dumps(args, ensure_ascii=False)) for name, args in pairs]


def streamed(make: Callable[[], ToolParser], text: str, size: int) -> ParsedOutput:
    parser = make()
    events = []
    for i in range(0, len(text), size):
        events += parser.feed(text[i : i + size])
    return collect(events + parser.finish())


def check(make, text: str, content: str | None, expected: list[ParsedCall]) -> None:
    whole = parse(make(), text)
    assert whole == ParsedOutput(content, expected)
    for size in (1, 5):
        assert streamed(make, text, size) == whole, size


@pytest.mark.parametrize(
    ("text", "content", "expected"),
    [
        ("The sky is blue.", "The sky is blue.", []),
        ("a < b and <tool", "a < b and <tool", []),  # a partial tag that never completes is text
        (f"<tool_call>\n{WEATHER}\n</tool_call>", None, calls(("get_weather", {"city": "Paris", "unit": "c"}))),
        (
            f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\n",
            "Let me look.\n",
            calls(("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "UTC"})),
        ),
        (f"<tool_call>{TIME}</tool_call> Done.", " Done.", calls(("get_time", {"zone": "UTC"}))),
        # malformed blocks stay in the content as written; the good one is still a call
        (
            f'<tool_call>{{"name": "f", "arguments": </tool_call>\n<tool_call>{TIME}</tool_call>',
            '<tool_call>{"name": "f", "arguments": </tool_call>\n',
            calls(("get_time", {"zone": "UTC"})),
        ),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
        # the generation ended inside a block: a complete body is a call, anything else is text
        (f"<tool_call>\n{TIME}\n", None, calls(("get_time", {"zone": "UTC"}))),
        ('<tool_call>\n{"name": "get_ti', '<tool_call>\n{"name": "get_ti', []),
        ('<tool_call>{"name": "f"}</tool_call>', None, calls(("f", {}))),  # no arguments: {}
        ('<tool_call>{"name": "f", "arguments": {"s": "</tool_call"}}</tool_call>', None, calls(("f", {"s": "</tool_call"}))),
    ],
)
def test_hermes(text, content, expected):
    check(HERMES, text, content, expected)


@pytest.mark.parametrize(
    ("text", "content", "expected"),
    [
        ("Just text.", "Just text.", []),
        ('{"name": "get_time", "parameters": {"zone": "UTC"}}', None, calls(("get_time", {"zone": "UTC"}))),
        (
            '<|python_tag|>{"name": "f", "parameters": {"x": [1, "}"]}}; {"name": "g", "arguments": {}}',
            None,
            calls(("f", {"x": [1, "}"]}), ("g", {})),
        ),
        ('{"name": "f", "parameters": {}}; and more', " and more", calls(("f", {}))),
        ('  {"answer": 42}', '  {"answer": 42}', []),  # JSON that is no call is content, untouched
        ('{"name": "f", "parameters": {"a": ', '{"name": "f", "parameters": {"a": ', []),  # cut off
        ("<|python_tag|>", "<|python_tag|>", []),
        ('The call: {"name": "f", "parameters": {}}', 'The call: {"name": "f", "parameters": {}}', []),
    ],
)
def test_llama3_json(text, content, expected):
    check(LLAMA, text, content, expected)


def test_required_and_named_outputs():
    array = '[{"name": "get_weather", "parameters": {"city": "Tokyo"}}, {"name": "get_time", "parameters": {}}]'
    check(required_parser, array, None, calls(("get_weather", {"city": "Tokyo"}), ("get_time", {})))
    check(required_parser, '[{"name": "f", "parameters": {"a": 1', '[{"name": "f", "parameters": {"a": 1', [])
    named = '{"city": "Tokyo", "unit": "f"}'
    check(lambda: NamedParser("get_weather"), named, None, [ParsedCall("get_weather", named)])
    check(lambda: NamedParser("get_weather"), "", "", [])
    # the named choice streams its arguments as they come, not once they are complete
    parser = NamedParser("f")
    assert [e.text for e in parser.feed('{"a"') if hasattr(e, "text")] == ['{"a"']


def test_the_engine_flag_lists_every_parser():
    assert set(config.TOOL_CALL_PARSERS) == set(TOOL_CALL_PARSERS)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]


def request(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_request(json.dumps(body).encode(), ChatCompletionRequest)


def plan(parser: str | None = "hermes", **fields) -> ToolPlan:
    return request(**fields).tool_plan(parser)


def stream_assembled(plan_: ToolPlan, text: str, engine_finish: str) -> tuple[dict, str | None]:
    """The chunks the server would send for `text` (in pieces of 3), assembled by the openai SDK."""
    state = ChatCompletionStreamState()
    c = ChoiceCalls(plan_)
    header = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m"}

    def send(delta: dict, finish: str | None = None) -> None:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        state.handle_chunk(ChatCompletionChunk.model_validate({**header, "choices": [choice]}))

    send({"role": "assistant", "content": ""})
    for i in range(0, len(text), 3):
        for delta in deltas(c.feed(text[i : i + 3])):
            send(delta)
    pieces = deltas(c.finish()) or [{}]
    for delta in pieces[:-1]:
        send(delta)
    send(pieces[-1], c.finish_reason(engine_finish))
    [choice] = state.get_final_completion().choices
    return choice.message.model_dump(include={"content", "tool_calls"}), choice.finish_reason


@pytest.mark.parametrize(
    ("fields", "parser", "text", "finish"),
    [
        ({"tools": TOOLS}, "hermes", f"Checking.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{TIME}</tool_call>", "tool_calls"),
        ({"tools": TOOLS}, "hermes", "No call here.", "stop"),
        ({"tools": TOOLS}, "llama3_json", '{"name": "get_time", "parameters": {}}', "tool_calls"),
        ({"tools": TOOLS, "tool_choice": "required"}, None, '[{"name": "get_time", "parameters": {"zone": "é"}}]', "tool_calls"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, None, '{"city": "Paris"}', "stop"),
    ],
)
def test_stream_deltas_assemble_into_the_whole_message(fields, parser, text, finish):
    p = plan(parser, **fields)
    whole, calls_ = message(p, text)
    assert calls_ is not None and calls_.finish_reason("stop") == finish
    assembled, assembled_finish = stream_assembled(p, text, "stop")
    assert assembled_finish == finish
    ids = [c["id"] for c in whole.get("tool_calls", [])]
    assert all(i.startswith("call_") and len(i) > 12 for i in ids) and len(set(ids)) == len(ids)
    named = [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])]
    got = [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in assembled["tool_calls"] or []]
    assert got == named and all(c["id"].startswith("call_") for c in assembled["tool_calls"] or [])
    assert (whole["content"] or None) == (assembled["content"] or None)


def test_no_parallel_calls_keeps_the_first_and_a_length_cut_is_no_tool_calls_finish():
    p = plan(tools=TOOLS, parallel_tool_calls=False)
    body, c = message(p, f"<tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>")
    assert [call["function"]["name"] for call in body["tool_calls"]] == ["get_weather"]
    assert c is not None and c.finish_reason("length") == "length"
    body, c = message(plan(tools=TOOLS, tool_choice="none"), f"<tool_call>{WEATHER}</tool_call>")
    assert c is None and body == {"role": "assistant", "content": f"<tool_call>{WEATHER}</tool_call>"}


@pytest.mark.parametrize(
    ("fields", "parser", "param", "words"),
    [
        ({"tools": []}, "hermes", "tools", "empty"),
        ({"tools": TOOLS + TOOLS[:1]}, "hermes", "tools", "unique"),
        ({"tool_choice": "required"}, "hermes", "tool_choice", "`tools` must be set"),
        ({"tool_choice": "auto"}, "hermes", "tool_choice", "`tools` must be set"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "hermes", "tool_choice", "must be set"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None, "tool_choice", "nope"),
        ({"tools": TOOLS}, None, "tool_choice", "--enable-auto-tool-choice"),  # auto is the default with tools
        ({"tools": TOOLS, "tool_choice": "auto"}, None, "tool_choice", "--enable-auto-tool-choice"),
    ],
)
def test_tool_fields_refused_as_vllm_does(fields, parser, param, words):
    with pytest.raises(InvalidRequestError) as err:
        plan(parser, **fields)
    assert err.value.param == param and words in err.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools[0].function.parameters"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_malformed_tool_fields_name_the_field(fields, param):
    with pytest.raises(InvalidRequestError) as err:
        request(**fields)
    assert err.value.param == param


def test_call_arguments_must_be_an_object_for_the_template():
    calls_ = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]
    with pytest.raises(InvalidRequestError) as err:
        request(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": calls_}]).conversation()
    assert err.value.param == "messages[1].tool_calls[0].function.arguments"


def test_required_schema_admits_exactly_the_calls_of_the_tools():
    """Checked with jsonschema as the oracle of what the schema means."""
    one = jsonschema.Draft202012Validator(required_schema([plan(tools=TOOLS).tools[0], plan(tools=TOOLS).tools[1]], False))
    assert one.is_valid([{"name": "get_weather", "parameters": {"city": "Paris"}}])
    assert one.is_valid([{"name": "get_time", "parameters": {}}])
    assert not one.is_valid([{"name": "get_weather", "parameters": {"city": "Rome"}}])
    assert not one.is_valid([{"name": "get_wether", "parameters": {"city": "Paris"}}])
    assert not one.is_valid([])
    two = [{"name": "get_time", "parameters": {}}] * 2
    assert not one.is_valid(two)
    assert jsonschema.Draft202012Validator(required_schema(plan(tools=TOOLS).tools, True)).is_valid(two)


def test_required_and_named_choices_set_the_constraint():
    params = SamplingParams()
    plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).constrain(params)
    assert params.structured_outputs is not None and params.structured_outputs.json is not None
    assert json.loads(params.structured_outputs.json)["maxItems"] == 1
    params = SamplingParams()
    plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}).constrain(params)
    assert params.structured_outputs is not None and params.structured_outputs.json is not None
    assert json.loads(params.structured_outputs.json) == TOOLS[0]["function"]["parameters"]  # vLLM's named schema
    for choice in ("auto", "none"):
        params = SamplingParams()
        plan(tools=TOOLS, tool_choice=choice).constrain(params)
        assert params.structured_outputs is None
