"""OpenAI request bodies as msgspec Structs, decoded strictly and turned into SamplingParams.

Unknown fields are ignored (the OpenAI SDK and other clients send extras); a field of the wrong
type is a 400 that names the field. Every optional field accepts `null`, which means "default".
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from data_plane.engine.sampling_params import SamplingParams
from shared.errors import InvalidRequestError

T = TypeVar("T", bound=msgspec.Struct)


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        """The message's content as one string; only text parts are supported."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.type != "text":
                raise InvalidRequestError(
                    f"Only text content parts are supported, got {part.type!r}.",
                    param=f"messages[{index}].content",
                )
            texts.append(part.text or "")
        return "".join(texts)


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by chat and completion requests (OpenAI plus the vLLM extras)."""

    model: str
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    return_token_ids: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Build (and so validate) the engine's parameters; None fields take the engine defaults."""
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported.", param="logit_bias")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stop):
            raise InvalidRequestError("Stop strings must not be empty.", param="stop")
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
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        kwargs = {k: v for k, v in given.items() if v is not None}
        return SamplingParams(max_tokens=max_tokens, stop=stop, logprobs=logprobs, **kwargs)


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # newer name of max_tokens; wins when both are given
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        """Refusals that need no tokenizer: checked before any work is done."""
        if not self.messages:
            raise InvalidRequestError("messages must contain at least one message.", param="messages")
        if self.tools:
            raise InvalidRequestError("Tool calling is not supported.", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError(
                "Only response_format type 'text' is supported.", param="response_format"
            )
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise InvalidRequestError("top_logprobs requires logprobs to be true.", param="top_logprobs")
            if not 0 <= self.top_logprobs <= 20:
                raise InvalidRequestError("top_logprobs must be between 0 and 20.", param="top_logprobs")

    def conversation(self) -> list[dict[str, str]]:
        """Messages in the shape chat templates expect: role and plain-text content."""
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]

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
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        if self.suffix:
            raise InvalidRequestError("suffix is not supported.", param="suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise InvalidRequestError("best_of is not supported (it must equal n).", param="best_of")
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError("echo together with logprobs is not supported.", param="echo")

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: each item a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt must not be empty.", param="prompt")
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


_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def decode_request(body: bytes, kind: type[T]) -> T:
    """Decode a JSON body into `kind`; malformed JSON or a wrong type is a 400 naming the field."""
    if not body.strip():
        raise InvalidRequestError("The request body is empty; expected a JSON object.")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"Invalid request: {exc}", param=_field_of(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"Malformed JSON body: {exc}") from None


def _field_of(message: str) -> str | None:
    """'Expected `int`, got `str` - at `$.messages[0].role`' → 'messages[0].role'."""
    path = _PATH.search(message)
    missing = _MISSING.search(message)
    parts = [p for p in (path.group(1) if path else "", missing.group(1) if missing else "") if p]
    return ".".join(parts) or None
