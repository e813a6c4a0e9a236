"""Request decoding and validation: what a client sends → SamplingParams, or a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from data_plane.api.protocol import ChatCompletionRequest, CompletionRequest, decode_request
from data_plane.engine.sampling_params import StructuredOutputsParams
from shared.errors import InvalidRequestError


def chat(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_request(json.dumps(body).encode(), ChatCompletionRequest)


def completion(**fields) -> CompletionRequest:
    body = {"model": "m", "prompt": "hi", **fields}
    return decode_request(json.dumps(body).encode(), CompletionRequest)


def test_chat_defaults_and_unknown_fields_ignored():
    req = chat(some_future_field={"x": 1}, user="u1", temperature=None)
    params = req.to_sampling_params(default_max_tokens=100)
    assert params.max_tokens == 100  # what is left of the context, like vLLM
    assert params.n == 1 and params.temperature == 1.0 and params.logprobs is None
    assert not req.include_usage


def test_chat_sampling_fields_reach_sampling_params():
    req = chat(
        max_tokens=5,
        max_completion_tokens=7,
        n=2,
        temperature=0,
        top_p=0.5,
        top_k=3,
        min_p=0.1,
        seed=42,
        stop="END",
        stop_token_ids=[9],
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        min_tokens=2,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=3,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    p = req.to_sampling_params(default_max_tokens=100)
    assert p.max_tokens == 7  # max_completion_tokens wins over max_tokens
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (2, 0.0, 0.5, 3, 0.1, 42)
    assert p.stop == ["END"] and p.stop_token_ids == [9]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert p.min_tokens == 2 and p.ignore_eos and p.logprobs == 3
    assert not p.skip_special_tokens and p.include_stop_str_in_output
    assert req.include_usage


def test_logit_bias_keys_become_token_ids_and_an_empty_map_means_none():
    assert chat(logit_bias={"7": 100, "0": -100, "3": 0.5}).to_sampling_params(10).logit_bias == {
        7: 100.0, 0: -100.0, 3: 0.5
    }
    assert completion(logit_bias={str(i): 1 for i in range(300)}).to_sampling_params().logit_bias == {
        i: 1.0 for i in range(300)
    }
    assert completion(logit_bias={}).to_sampling_params().logit_bias is None


def test_chat_logprobs_without_top_logprobs_means_zero_alternatives():
    assert chat(logprobs=True).to_sampling_params(10).logprobs == 0


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"stop": ["ok", ""]}, "stop[1]"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": {"1": -100.5}}, "logit_bias"),
        ({"logit_bias": {"x": 5}}, "logit_bias"),
        ({"logit_bias": {"1.5": 5}}, "logit_bias"),
        ({"logit_bias": {"-1": 5}}, "logit_bias"),
        ({"logit_bias": {"1": "5"}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ],
)
def test_chat_invalid_sampling_values_name_the_field(fields, param):
    with pytest.raises(InvalidRequestError) as err:
        chat(**fields).to_sampling_params(default_max_tokens=10)
    assert err.value.param == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs=true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ],
)
def test_chat_check_refusals(fields, param):
    with pytest.raises(InvalidRequestError) as err:
        chat(**fields).check()
    assert err.value.param == param


def test_chat_content_parts_are_joined_and_non_text_parts_refused():
    req = chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    )
    assert req.conversation() == [{"role": "user", "content": "ab"}]
    with pytest.raises(InvalidRequestError) as err:  # the schema's enum: only text parts
        chat(messages=[{"role": "system", "content": None}, {"role": "user", "content": [{"type": "image_url"}]}])
    assert err.value.param == "messages[1].content[0].type"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "10"}', "max_tokens"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 1.5}', "n"),
        (b'{"model": "m", "messages": [{"content": "x"}]}', "messages[0].role"),
        (b'{"model": "m", "messages": "hello"}', "messages"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
        (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
    ],
)
def test_wrong_types_are_400_naming_the_field(body, param):
    with pytest.raises(InvalidRequestError) as err:
        decode_request(body, ChatCompletionRequest)
    assert err.value.param == param
    assert err.value.status_code == 400


@pytest.mark.parametrize("body", [b"", b"   ", b"{not json", b'{"model": "m",', b"[1, 2]"])
def test_malformed_bodies_are_400(body):
    with pytest.raises(InvalidRequestError):
        decode_request(body, ChatCompletionRequest)


def test_completion_prompt_forms():
    assert completion(prompt="abc").prompts() == ["abc"]
    assert completion(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert completion(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert completion(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    for bad in ([], ["a", 1], [[1], "a"]):
        with pytest.raises(InvalidRequestError) as err:
            completion(prompt=bad).prompts()
        assert err.value.param == "prompt"


def test_completion_defaults_and_logprobs():
    assert completion().to_sampling_params().max_tokens == 16
    assert completion(max_tokens=None).to_sampling_params().max_tokens == 16
    assert completion(logprobs=2).to_sampling_params().logprobs == 2
    with pytest.raises(InvalidRequestError) as err:
        completion(logprobs=21).to_sampling_params()
    assert err.value.param == "logprobs"


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of"), ({"echo": True, "logprobs": 1}, "echo")],
)
def test_completion_refusals(fields, param):
    with pytest.raises(InvalidRequestError) as err:
        completion(**fields).check()
    assert err.value.param == param


def test_completion_best_of_equal_to_n_is_accepted():
    completion(best_of=2, n=2).check()


def test_integral_floats_count_as_integers_as_in_json_schema():
    req = decode_request(b'{"model": "m", "prompt": "x", "n": 2.0, "stop_token_ids": [3.0], "top_p": 1}', CompletionRequest)
    assert req.n == 2 and req.stop_token_ids == [3] and req.top_p == 1.0
    with pytest.raises(InvalidRequestError) as err:
        decode_request(b'{"model": "m", "prompt": "x", "n": 2.5}', CompletionRequest)
    assert err.value.param == "n"


def test_deeply_nested_json_is_400_not_500():
    deep = b"[" * 100_000 + b"]" * 100_000
    for body in (b'{"model": "m", "prompt": "x", "extra": ' + deep + b"}", b'{"model": "m", "prompt": "x", "n": 1.0, "x": ' + deep + b"}"):
        with pytest.raises(InvalidRequestError, match="nested too deeply"):
            decode_request(body, CompletionRequest)


SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x"]}}}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
         StructuredOutputsParams(json=json.dumps(SCHEMA, separators=(",", ":")))),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=json.dumps(SCHEMA, separators=(",", ":")))),
        ({"structured_outputs": {"json": '{"type": "object"}'}}, StructuredOutputsParams(json='{"type": "object"}')),
        ({"structured_outputs": {"regex": "a+"}}, StructuredOutputsParams(regex="a+")),
        ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputsParams(choice=["a", "b"])),
        ({"structured_outputs": {"grammar": "start: /a/"}}, StructuredOutputsParams(grammar="start: /a/")),
        ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True)),
    ],
)
def test_response_format_and_structured_outputs_become_the_constraint(fields, expected):
    assert chat(**fields).to_sampling_params(default_max_tokens=10).structured_outputs == expected
    assert completion(**fields).to_sampling_params().structured_outputs == expected


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "grammar": "start: /a/"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format.json_schema"),
    ],
)
def test_an_unusable_constraint_names_its_field(fields, param):
    with pytest.raises(InvalidRequestError) as err:
        chat(**fields).to_sampling_params(default_max_tokens=10)
    assert err.value.param == param
