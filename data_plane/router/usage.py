"""How many tokens a request used, read from the engine's answer as it passes, and what to reserve first.

Admission reserves `reservation(body)` tokens: the prompt's bytes / 4 (a tokenizer-free upper estimate
for the usual text, which the engines' usage then corrects) plus `max_tokens` (or `max_completion_tokens`;
16, OpenAI's completions default, when neither is given). After the answer the reservation is settled
against the engine's `usage.total_tokens`.

Non-streamed answers carry `usage` in their JSON. Streams carry it in a last event with no choices when
the request says `stream_options: {"include_usage": true}`: `ask_for_usage` adds that to a streamed
request that does not ask itself, and `UsageTap` then takes that event out of the stream (the client
did not ask for it), keeping its figures.
"""

from __future__ import annotations

from typing import Any

import msgspec

DEFAULT_MAX_TOKENS = 16
_BYTES_PER_TOKEN = 4
_MARK = b'"usage":{'
_TAIL = 8192  # the usage event (a few hundred bytes) comes just before [DONE]


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class _Sized(msgspec.Struct):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    prompt: msgspec.Raw = msgspec.Raw(b"")
    messages: msgspec.Raw = msgspec.Raw(b"")
    stream_options: dict[str, Any] | None = None


class _Answer(msgspec.Struct):
    usage: Usage | None = None
    choices: list[msgspec.Raw] = msgspec.field(default_factory=list)


_sized = msgspec.json.Decoder(_Sized)
_answer = msgspec.json.Decoder(_Answer)


def reservation(body: bytes) -> tuple[int, bool]:
    """(tokens to reserve at admission, whether the request asks for stream usage itself)."""
    try:
        sized = _sized.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return DEFAULT_MAX_TOKENS, False
    generated = sized.max_tokens or sized.max_completion_tokens or DEFAULT_MAX_TOKENS
    prompt = (len(sized.messages) or len(sized.prompt)) // _BYTES_PER_TOKEN + 1
    asked = bool(sized.stream_options and sized.stream_options.get("include_usage"))
    return max(1, generated) + prompt, asked


def ask_for_usage(body: bytes) -> bytes:
    """The request with `stream_options.include_usage` set (re-encoded: streams of tenant keys only)."""
    request = msgspec.json.decode(body)
    options = request.get("stream_options") or {}
    request["stream_options"] = {**options, "include_usage": True}
    return msgspec.json.encode(request)


def usage_of(body: bytes) -> Usage | None:
    """`usage` of a whole JSON answer (None when it has none: an error)."""
    try:
        return _answer.decode(body).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class UsageTap:
    """What the proxy shows an answer to: a whole JSON body (`whole`), or every chunk of an SSE answer
    (`feed` returns what to pass on, `flush` what is left at the end); `usage` is set once it went by.
    With `strip`, a stream's usage event (a chunk with no choices and a usage) is held back."""

    def __init__(self, strip: bool) -> None:
        self.strip = strip
        self.usage: Usage | None = None
        self._pending = b""  # an event not complete yet (only while stripping, or near a usage mark)

    def whole(self, body: bytes) -> None:
        self.usage = usage_of(body)

    def feed(self, chunk: bytes) -> bytes:
        if not self.strip:  # the client asked for it: pass everything, read the tail at the end
            self._pending = (self._pending + chunk)[-_TAIL:]
            return chunk
        data = self._pending + chunk
        head, sep, self._pending = data.rpartition(b"\n\n")
        if not sep:
            self._pending = data
            return b""
        if _MARK not in head:
            return head + sep
        return b"".join(e + b"\n\n" for e in head.split(b"\n\n") if not self._take(e))

    def flush(self) -> bytes:
        """What is still held at the end of the stream."""
        rest, self._pending = self._pending, b""
        if not self.strip:
            for event in rest.split(b"\n\n"):
                self._take(event)
            return b""
        return b"" if self._take(rest) else rest

    def _take(self, event: bytes) -> bool:
        """Whether `event` is the usage event (its figures kept)."""
        if _MARK not in event or not event.startswith(b"data: {"):
            return False
        try:
            answer = _answer.decode(event[6:])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False
        if answer.usage is None or answer.choices:
            return False
        self.usage = answer.usage
        return True
