"""How many tokens a request uses, read from the engine's answer as it passes, and what to reserve first.

Admission reserves `Reservation.tokens`, the most a request may use: for each prompt, its tokens (token
ids counted; text estimated, its JSON bytes / 4 + 1, tokenizer-free: the engine's exact count replaces
it as soon as its usage arrives) plus, for each of its samples (`n`, or `best_of` when larger), what
it may generate: `max_tokens` (`max_completion_tokens` first for chat, as the engines read them), else
the context left (the engines' max_model_len less the prompt) for chat and 16 (OpenAI's default) for
completions. `check_ceiling` refuses a reservation past the router's --max-request-tokens (400).

Non-streamed answers carry `usage` in their JSON. Streams of tenant keys are asked for vLLM's
`stream_options: {"include_usage": true, "continuous_usage_stats": true}` (`ask_for_usage`): every
chunk then carries the usage so far (exact prompt tokens from the first chunk on, completion tokens as
they are generated) and a last event with no choices the final one. `UsageTap` reads each event's usage
as it passes (calling `on_usage`, which meters the stream) and gives the client what it asked for:

    client asked                      chunks' "usage"        the last usage event
    nothing                           taken out              taken out
    include_usage                     null (as OpenAI's)     passed on
    include_usage + continuous        passed on              passed on

The engines put `usage` last in a chunk (`…,"usage":{…}}`), so it is found and cut by one `rfind` per
event, without decoding or re-encoding the chunk; an event with fields after it (vLLM's last one ends
with `system_fingerprint`) is decoded whole. An engine that does not send continuous usage is metered by
its last usage event alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from shared.errors import InvalidRequestError

DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's default, the engines' too)
_BYTES_PER_TOKEN = 4
_KEY = b',"usage":'
_NULL = b',"usage":null'
_FINAL = b'"choices":[]'  # what comes just before `usage` in the last event
_DATA = b"data: {"


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class _StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Sized(msgspec.Struct):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None
    best_of: int | None = None
    prompt: msgspec.Raw = msgspec.Raw(b"")
    messages: msgspec.Raw = msgspec.Raw(b"")
    stream_options: _StreamOptions | None = None


class _Answer(msgspec.Struct):
    usage: Usage | None = None


_sized = msgspec.json.Decoder(_Sized)
_items = msgspec.json.Decoder(list[msgspec.Raw])
_answer = msgspec.json.Decoder(_Answer)
_usage = msgspec.json.Decoder(Usage)


@dataclass(frozen=True)
class Reservation:
    prompt: int  # the prompts' tokens (counted or estimated)
    generated: int  # the most it may generate: every sample of every prompt
    asked_usage: bool = False  # the client's stream_options.include_usage
    asked_continuous: bool = False  # … and continuous_usage_stats

    @property
    def tokens(self) -> int:
        return self.prompt + self.generated


def reservation(body: bytes, context: int | None) -> Reservation:
    """What to reserve at admission (see the module docstring; `context`: the model's max_model_len, None
    when unknown: 16 tokens a sample then), and what usage the client itself asked its stream for. A body
    the engines would refuse (a field of the wrong type) reserves a token or so: they answer it 400."""
    try:
        sized = _sized.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return Reservation(1, DEFAULT_MAX_TOKENS)
    chat = len(sized.messages) > 0
    prompts = [_estimate(len(sized.messages))] if chat else _prompts(bytes(sized.prompt))
    samples = max(1, sized.n or 1, 1 if chat else sized.best_of or 1)
    asked = sized.max_completion_tokens if chat and sized.max_completion_tokens is not None else sized.max_tokens
    generated = 0
    for tokens in prompts:
        if asked is not None:
            each = asked
        elif chat and context:
            each = context - tokens
        else:
            each = DEFAULT_MAX_TOKENS
        generated += samples * max(1, each)
    options = sized.stream_options
    usage = bool(options and options.include_usage)
    return Reservation(sum(prompts), generated, usage, usage and bool(options and options.continuous_usage_stats))


def check_ceiling(reserved: Reservation, ceiling: int | None) -> None:
    """400 for a request that may use more tokens than the router lets one request use (None: no ceiling)."""
    if ceiling is not None and reserved.tokens > ceiling:
        raise InvalidRequestError(
            f"This request may use {reserved.tokens} tokens (its prompts, and max_tokens for each of its n "
            f"samples of each prompt, or the context left without max_tokens), more than this router's "
            f"ceiling of {ceiling} tokens per request (--max-request-tokens). Lower max_tokens "
            "(max_completion_tokens), n or the number of prompts.", param="max_tokens")


def _estimate(size: int) -> int:
    """The tokens of a prompt of `size` JSON bytes, tokenizer-free: a quarter of them, plus one."""
    return size // _BYTES_PER_TOKEN + 1


def _prompts(raw: bytes) -> list[int]:
    """The tokens of each prompt of a completion's `prompt` (a string, strings, token ids or lists of them):
    token ids are counted (commas + 1: the engines refuse any list of ids with anything else in it)."""
    if not raw.startswith(b"["):
        return [_estimate(len(raw))]
    first = raw[1:].lstrip()[:1]
    if first.isdigit() or first == b"-":
        return [raw.count(b",") + 1]  # one prompt of token ids
    try:
        items = [bytes(item) for item in _items.decode(raw)]
    except (msgspec.DecodeError, msgspec.ValidationError):
        return [_estimate(len(raw))]
    return [item.count(b",") + 1 if item.startswith(b"[") else _estimate(len(item)) for item in items] or [1]


def ask_for_usage(body: bytes) -> bytes:
    """The request with include_usage and continuous_usage_stats set (re-encoded: tenant keys' streams)."""
    request: dict[str, Any] = msgspec.json.decode(body)
    options = request.get("stream_options") or {}
    request["stream_options"] = {**options, "include_usage": True, "continuous_usage_stats": True}
    return msgspec.json.encode(request)


def usage_of(body: bytes) -> Usage | None:
    """`usage` of a whole JSON answer (None when it has none: an error)."""
    try:
        return _answer.decode(body).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class UsageTap:
    """What the proxy shows an answer to: a whole JSON body (`whole`), or every chunk of an SSE answer
    (`feed` returns what to pass on, `flush` what is left at the end). `usage` is the latest seen (the
    final one once the stream ended); `on_usage` is called with each."""

    def __init__(self, reserved: Reservation | None = None, on_usage: Callable[[Usage], None] | None = None) -> None:
        asked = reserved or Reservation(0, 0, True, True)
        self.keep_all = asked.asked_continuous
        self.keep_final = asked.asked_usage
        self.on_usage = on_usage
        self.usage: Usage | None = None
        self._pending = b""  # the start of an event not complete yet

    def whole(self, body: bytes) -> None:
        self.usage = usage_of(body)

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk if self._pending else chunk
        head, sep, self._pending = data.rpartition(b"\n\n")
        if not sep:
            self._pending = data
            return b""
        events = [self._event(e) for e in head.split(b"\n\n")]
        if self.keep_all:
            return head + sep
        return b"".join(e + b"\n\n" for e in events if e)

    def flush(self) -> bytes:
        """What is still held at the end of the stream (an event without its blank line)."""
        rest, self._pending = self._pending, b""
        return self._event(rest) if rest else b""

    def _event(self, event: bytes) -> bytes:
        """The event as the client gets it (b"" to drop it); its usage read on the way."""
        at = event.rfind(_KEY)
        if at < 0 or not event.startswith(_DATA):
            return event
        if not event.endswith(b"}}"):
            return self._decoded(event)
        try:
            usage = _usage.decode(event[at + len(_KEY):-1])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return self._decoded(event)
        self._seen(usage)
        if self.keep_all:
            return event
        if event[at - len(_FINAL):at] == _FINAL:  # the last event: no choices, then the usage
            return event if self.keep_final else b""
        return event[:at] + (_NULL if self.keep_final else b"") + b"}"

    def _decoded(self, event: bytes) -> bytes:
        """`_event` for an event whose usage is not its last field (vLLM's last event puts
        `system_fingerprint` after it), decoded whole: only such events pay for it. One without a usage
        we know passes untouched."""
        try:
            chunk = msgspec.json.decode(event[len(_DATA) - 1:])
            usage = msgspec.convert(chunk["usage"], Usage)
            final = chunk["choices"] == []
        except (msgspec.DecodeError, msgspec.ValidationError, KeyError, TypeError):
            return event
        self._seen(usage)
        if self.keep_all:
            return event
        if final:
            return event if self.keep_final else b""
        if self.keep_final:
            chunk["usage"] = None
        else:
            del chunk["usage"]
        return _DATA[:-1] + msgspec.json.encode(chunk)

    def _seen(self, usage: Usage) -> None:
        self.usage = usage
        if self.on_usage is not None:
            self.on_usage(usage)
