"""What a tool-call parser reports as model text streams in, and the whole-text parse built on it.

A parser is fed the generated text piece by piece (`feed`) and told when it ends (`finish`); it answers
events in output order: `Text` (content for the client), `CallStart` (a call's function name) and
`CallArguments` (a piece of that call's JSON arguments). The non-streaming parse feeds the whole text at
once, so both forms give the same calls and the same content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # 0, 1, ... in the order the calls were written
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str  # a piece of the call's arguments; the pieces of one call join to a JSON object's text


Event = Text | CallStart | CallArguments


class ToolParser(Protocol):
    def feed(self, text: str) -> list[Event]:
        """Events for the text generated since the last call (some text may be held back)."""

    def finish(self) -> list[Event]:
        """Events for whatever was held back, once the generation has ended."""


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass
class ParsedOutput:
    content: str | None  # text outside the calls; None when calls were made and nothing else was said
    calls: list[ParsedCall] = field(default_factory=list)


def collect(events: list[Event]) -> ParsedOutput:
    """Assemble events into content and calls."""
    text: list[str] = []
    calls: list[ParsedCall] = []
    for event in events:
        if isinstance(event, Text):
            text.append(event.text)
        elif isinstance(event, CallStart):
            calls.append(ParsedCall(event.name, ""))
        else:
            calls[event.index].arguments += event.text
    content = "".join(text)
    return ParsedOutput(None if calls and not content.strip() else content, calls)


def parse(parser: ToolParser, text: str) -> ParsedOutput:
    """The whole generated `text` through a fresh `parser`."""
    return collect(parser.feed(text) + parser.finish())


def call_from_object(obj: Any, arguments_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a decoded `{"name": ..., <arguments key>: {...}}`, or None when
    `obj` is not one: no string name, or arguments that are not an object. Missing arguments are `{}`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in arguments_keys if k in obj), None)
    arguments = {} if key is None else obj[key]
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (they wait for the next piece)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class JsonValueEnd:
    """Finds where a JSON object or array that starts at a given place ends, fed piece by piece.

    `start(text, pos)` begins at text[pos] ('{' or '['); `scan(text)` goes on over the text as it has
    grown and returns the index just past the value once its brackets close (strings and escapes
    respected), else None. The text is only ever appended to between calls.
    """

    def __init__(self) -> None:
        self._pos = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def start(self, pos: int) -> None:
        self._pos, self._depth, self._in_string, self._escaped = pos, 0, False, False

    def scan(self, text: str) -> int | None:
        while self._pos < len(text):
            ch = text[self._pos]
            self._pos += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return self._pos
        return None
