"""The engine's response shapes (OpenAI's, plus vLLM's extras) as msgspec Structs, for the OpenAPI
document. The serving layer builds these bodies as dicts; the contract tests (schemathesis) check
every body against these schemas, so the two cannot drift apart unnoticed.

Fields with a default are the ones that are present only sometimes (e.g. `token_ids` only with
`return_token_ids`).
"""

from __future__ import annotations

from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]
StopReason = str | int | None  # the stop string or stop token id that ended the choice


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text of an object


class ToolCall(msgspec.Struct):
    id: str  # call_...
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str | None  # null when the answer is only tool calls
    tool_calls: list[ToolCall] | None = None  # the calls made (data_plane/api/tool_calls.py)


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StopReason
    token_ids: list[int] | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class FunctionCallDelta(msgspec.Struct):
    name: str | None = None  # in a call's first piece
    arguments: str | None = None  # "" in the first piece, then pieces of the JSON text


class ToolCallDelta(msgspec.Struct):
    """A piece of a call: the first carries id, type and the function's name; later ones index and arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(msgspec.Struct):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StopReason = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(msgspec.Struct):
    """One `data:` event of a streamed chat completion; the last one (with include_usage) has no choices."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StopReason = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class Completion(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(msgspec.Struct):
    """One `data:` event of a streamed completion; the last one (with include_usage) has no choices."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None  # the base model's name for an adapter; null for the base model
    max_model_len: int
    # an adapter's version in the control plane's registry (null: the base model, or loaded directly)
    version: int | None = None


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[ModelCard]


class Health(msgspec.Struct):
    status: Literal["ok"]


class Version(msgspec.Struct):
    version: str
