"""OpenAI request bodies as msgspec Structs, decoded strictly and turned into SamplingParams.

Unknown fields are ignored (the OpenAI SDK and other clients send extras); a field of the wrong
type is a 400 that names the field. Every optional field accepts `null`, which means "default".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from data_plane.api.tool_calls import Tool, ToolCall, ToolChoice, ToolPlan, template_tool_calls
from data_plane.engine.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, StructuredOutputsParams
from shared.errors import InvalidRequestError
from shared.openapi import decode_body

T = TypeVar("T", bound=msgspec.Struct)

# Every range a validator can check lives in the type, so the OpenAPI schema states it and the
# decoder enforces it (a 400 naming the field). Limits that depend on the engine's flags (n, stop
# strings, max_tokens) are filled in per engine by `request_types`.
Temperature = Annotated[float, Meta(ge=0.0, description="0 is greedy")]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1, description="-1 or 0 disables top-k")]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=2.0)]
Seed = Annotated[int, Meta(ge=SEED_MIN, le=SEED_MAX, description="a signed 64-bit integer")]
TokenId = Annotated[int, Meta(ge=0)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
StopString = Annotated[str, Meta(min_length=1)]
# OpenAI's bound on a bias; the entry count is ours (a request may not make every step scatter thousands).
MAX_LOGIT_BIAS_ENTRIES = 300
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
Unsupported = Meta(max_length=0, description="not supported: must be absent, null or empty")


class ContentPart(msgspec.Struct):
    type: Literal["text"]  # only text parts are supported
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message's answer to

    def text(self) -> str:
        """The message's content as one string (the schema admits text parts only)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text or "" for part in self.content)


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: every chunk carries the usage so far (with include_usage)


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """response_format's json_schema: the output is JSON valid under `schema` (strict or not), written without
    free whitespace (docs/structured-outputs.md)."""

    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(msgspec.Struct, kw_only=True):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object), or json_schema."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


Choices = Annotated[list[str], Meta(min_length=1)]


class StructuredOutputs(msgspec.Struct, kw_only=True):
    """vLLM's structured_outputs: exactly one of json (a JSON schema, as an object or as JSON text),
    json_object, regex, choice or grammar (Lark, llguidance's dialect)."""

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: Choices | None = None
    grammar: str | None = None


def structured_outputs_params(
    response_format: ResponseFormat | None, structured: StructuredOutputs | None
) -> StructuredOutputsParams | None:
    """The request's output constraint, from OpenAI's response_format or vLLM's structured_outputs."""
    constrained_format = response_format is not None and response_format.type != "text"
    if structured is not None:
        if constrained_format:
            raise InvalidRequestError("Give response_format or structured_outputs, not both.", param="structured_outputs")
        schema = structured.json
        return StructuredOutputsParams(
            json=_schema_text(schema) if isinstance(schema, dict) else schema,
            json_object=bool(structured.json_object),
            regex=structured.regex,
            choice=structured.choice,
            grammar=structured.grammar,
        )
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if response_format.json_schema is None or response_format.json_schema.schema is None:
        raise InvalidRequestError(
            "response_format of type json_schema needs json_schema.schema.", param="response_format.json_schema"
        )
    return StructuredOutputsParams(json=_schema_text(response_format.json_schema.schema))


def _schema_text(schema: dict[str, Any]) -> str:
    return msgspec.json.encode(schema).decode()


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by chat and completion requests (OpenAI plus the vLLM extras)."""

    model: str
    n: int | None = None  # range: request_types
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: StopString | list[StopString] | None = None  # lengths: request_types
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: Annotated[dict[TokenId, Bias], Meta(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None  # ids: request_types
    user: str | None = None
    # vLLM extras
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: int | None = None  # range: request_types
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    return_token_ids: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None

    @property
    def structured_param(self) -> str:
        """The field a constraint's 400 names."""
        given = self.response_format is not None and self.response_format.type != "text"
        return "response_format" if given else "structured_outputs"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far, as vLLM's (the router meters tenants' streams by it)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def _sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Build (and so validate) the engine's parameters; None fields take the engine defaults."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        given: dict[str, Any] = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": self.logit_bias or None,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        kwargs = {k: v for k, v in given.items() if v is not None}
        structured = structured_outputs_params(self.response_format, self.structured_outputs)
        return SamplingParams(
            max_tokens=max_tokens, stop=stop, logprobs=logprobs, structured_outputs=structured, **kwargs
        )


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: int | None = None  # range: request_types
    max_completion_tokens: int | None = None  # newer name of max_tokens; wins when both are given
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # default: true

    def check(self) -> None:
        """Refusals that need no tokenizer: checked before any work is done."""
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true.", param="top_logprobs")

    def conversation(self) -> list[dict[str, Any]]:
        """Messages in the shape chat templates expect: role and plain-text content, an assistant's
        tool_calls (arguments as objects) and a tool message's tool_call_id."""
        out = []
        for i, m in enumerate(self.messages):
            message: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                message["tool_calls"] = template_tool_calls(m.tool_calls, f"messages[{i}].tool_calls")
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        return out

    def tool_plan(self, auto_parser: str | None) -> ToolPlan:
        """The request's tool fields checked (data_plane/api/tool_calls.py)."""
        return ToolPlan.of(self.tools, self.tool_choice, self.parallel_tool_calls, auto_parser)

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """default_max_tokens: what is left of the context after the prompt (as vLLM does)."""
        max_tokens = next(
            (v for v in (self.max_completion_tokens, self.max_tokens) if v is not None), default_max_tokens
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


class CompletionRequest(_SamplingFields, kw_only=True):
    # str | list[int] | list[str] | list[list[int]]; msgspec allows one array type per union, so the
    # list's items are a union and `prompts()` checks the list is homogeneous.
    prompt: str | Annotated[list[str | TokenId | list[TokenId]], Meta(min_length=1)]
    max_tokens: int | None = 16  # range: request_types
    echo: bool | None = None
    logprobs: TopLogprobs | None = None
    suffix: Annotated[str, Unsupported] | None = None
    best_of: Annotated[int, Meta(ge=1, description="must equal n")] | None = None

    def check(self) -> None:
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise InvalidRequestError("best_of is not supported (it must equal n).", param="best_of")
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError("echo together with logprobs is not supported.", param="echo")

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: each item a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        if all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            return list(p)  # type: ignore[arg-type]
        raise InvalidRequestError(
            "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids.",
            param="prompt",
        )

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs)


@dataclass(frozen=True)
class RequestTypes:
    """This engine's request Structs: the shared fields plus the ranges its flags set."""

    chat: type[ChatCompletionRequest]
    completion: type[CompletionRequest]


def _prompt_type(vocab_size: int) -> Any:
    """`prompt` with token ids within the vocabulary and nothing empty. The decoder takes one array
    type per union, so it decodes a looser shape and `prompts()` refuses mixed lists; the schema's
    allOf states the exact four shapes."""
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    text = {"type": "string", "minLength": 1}
    exact = {
        "anyOf": [
            text,
            {"type": "array", "minItems": 1, "items": text},
            {"type": "array", "minItems": 1, "items": token_id},
            {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1, "items": token_id}},
        ]
    }
    token = Annotated[int, Meta(ge=0, le=vocab_size - 1)]
    string = Annotated[str, Meta(min_length=1)]
    items = string | token | Annotated[list[token], Meta(min_length=1)]
    description = "a string, a list of strings, a list of token ids or a list of lists of token ids"
    return Annotated[
        string | Annotated[list[items], Meta(min_length=1)],
        Meta(description=description, extra_json_schema={"allOf": [exact]}),
    ]


def _ids_below(limit: int) -> str:
    """A regular expression matching exactly the decimal integers in [0, limit), as JSON object keys are
    written (no sign, no leading zero): what a schema can say of the keys of a map."""
    top = str(limit - 1)
    width = len(top)
    alternatives = ["0"] + ([f"[1-9][0-9]{{0,{width - 2}}}"] if width > 1 else [])  # fewer digits than top
    for i, digit in enumerate(top):  # top's first i digits, a smaller digit, then any digits
        low = 1 if i == 0 else 0
        if int(digit) > low:
            alternatives.append(f"{top[:i]}[{low}-{int(digit) - 1}][0-9]{{{width - i - 1}}}")
    alternatives.append(top)
    return "^(" + "|".join(alternatives) + ")$"


def _logit_bias_type(vocab_size: int) -> Any:
    """`logit_bias`: token ids (JSON object keys, so strings of integers) within the vocabulary, each
    mapped to a bias in [-100, 100], at most MAX_LOGIT_BIAS_ENTRIES of them."""
    token = Annotated[int, Meta(ge=0, le=vocab_size - 1)]
    description = (
        f"token id (a key in [0, {vocab_size})) -> bias in [-100, 100], added to the logits before sampling "
        f"(greedy included); at most {MAX_LOGIT_BIAS_ENTRIES} entries"
    )
    names = {"propertyNames": {"pattern": _ids_below(vocab_size)}}
    meta = Meta(max_length=MAX_LOGIT_BIAS_ENTRIES, description=description, extra_json_schema=names)
    return Annotated[dict[token, Bias], meta] | None


def request_types(
    max_model_len: int, max_n: int, max_stop_strings: int, max_stop_string_length: int, vocab_size: int
) -> RequestTypes:
    """Subclasses that only narrow the engine-dependent fields, so decoding enforces them and the
    OpenAPI schema states them: n <= --max-n, stop strings per --max-stop-strings and
    --max-stop-string-length, max_tokens and min_tokens within the context, prompt token ids within
    the vocabulary, logit_bias ids within the vocabulary."""
    stop_string = Annotated[str, Meta(min_length=1, max_length=max_stop_string_length)]
    stop = stop_string | Annotated[list[stop_string], Meta(max_length=max_stop_strings)] | None
    n = Annotated[int, Meta(ge=1, le=max_n, description="samples per prompt (--max-n)")] | None
    max_tokens = Annotated[int, Meta(ge=1, le=max_model_len, description="tokens to generate")] | None
    min_tokens = Annotated[int, Meta(ge=0, le=max_model_len)] | None
    logit_bias = _logit_bias_type(vocab_size)
    shared = [("n", n, None), ("stop", stop, None), ("min_tokens", min_tokens, None), ("logit_bias", logit_bias, None)]
    chat = msgspec.defstruct(
        "ChatCompletionRequest",
        [*shared, ("max_tokens", max_tokens, None), ("max_completion_tokens", max_tokens, None)],
        bases=(ChatCompletionRequest,),
        kw_only=True,
        module=__name__,
    )
    completion = msgspec.defstruct(
        "CompletionRequest",
        [*shared, ("max_tokens", max_tokens, 16), ("prompt", _prompt_type(vocab_size))],
        bases=(CompletionRequest,),
        kw_only=True,
        module=__name__,
    )
    return RequestTypes(chat, completion)  # type: ignore[arg-type]


# Fields that are accepted only absent, null or empty: say so rather than quote the length rule.
_UNSUPPORTED = {"suffix"}


def decode_request(body: bytes, kind: type[T]) -> T:
    """Decode a JSON body into `kind` strictly (shared.openapi.decode_body); malformed JSON or a wrong
    type is a 400 naming the field, and a field we accept only empty says that it is unsupported."""
    try:
        return decode_body(body, kind)
    except InvalidRequestError as exc:
        if exc.param in _UNSUPPORTED:
            detail = exc.message.removeprefix("Invalid request: ")
            raise InvalidRequestError(f"{exc.param} is not supported: {detail}", param=exc.param) from None
        if exc.param is not None and exc.param.startswith("logit_bias"):  # "logit_bias[...]" for a value
            detail = exc.message.removeprefix("Invalid request: ")
            raise InvalidRequestError(
                "logit_bias maps token ids within the vocabulary to biases in [-100, 100], "
                f"at most {MAX_LOGIT_BIAS_ENTRIES} of them: {detail}",
                param="logit_bias",
            ) from None
        raise
