"""Calls written as JSON objects: `llama3_json` (Llama 3.1+: `{"name": ..., "parameters": {...}}`, maybe
after `<|python_tag|>`, several separated by `;`), the array a `required` tool choice makes the model write
(`[{"name": ..., "parameters": {...}}, ...]`), and a named tool choice's bare arguments object.

A sequence parser decides from the start of the output: calls if it opens as the format does, plain text
otherwise. Each object that closes and has a string `name` and an object of arguments is a call as soon
as it closes; the first thing that is not one ends the calls, and the text from there on is content.
"""

from __future__ import annotations

import json

from data_plane.api.tool_parsers.base import (
    CallArguments,
    CallStart,
    Event,
    JsonValueEnd,
    Text,
    call_from_object,
)

PYTHON_TAG = "<|python_tag|>"


class JsonSequenceParser:
    """Objects after an optional `opener`, separated by `separator`, optionally closed by `closer`."""

    def __init__(self, openers: tuple[str, ...], separator: str, closer: str | None, arguments_keys: tuple[str, ...]):
        self._openers = openers  # the output is calls if it begins (after whitespace) with one of these
        self._separator = separator
        self._closer = closer
        self._arguments_keys = arguments_keys
        self._text = ""  # the whole output so far
        self._pos = 0  # where the unreported part of the output begins
        self._state = "start"  # start | between | object | text | done
        self._object = JsonValueEnd()
        self._calls = 0

    def feed(self, text: str) -> list[Event]:
        self._text += text
        events: list[Event] = []
        while True:
            step = self._step()
            if step is None:
                return events
            events += step

    def finish(self) -> list[Event]:
        events = self.feed("")
        rest = self._text[self._pos :]
        self._pos = len(self._text)
        if self._state in ("start", "between", "object"):
            if not self._calls:
                rest = self._text  # no call: all of it is content
            if rest.strip() or (rest and not self._calls):
                events.append(Text(rest))
        return events

    def _to_text(self) -> list[Event]:
        """The rest is content; with no call made, all of it (nothing was reported before the first)."""
        self._state = "text"
        if not self._calls:
            self._pos = 0
        return []

    def _step(self) -> list[Event] | None:
        """Advance over the output once; None when it needs more text."""
        rest = self._text[self._pos :]
        if self._state == "text":
            self._pos = len(self._text)
            return [Text(rest)] if rest else None
        if self._state == "done":
            self._pos = len(self._text)
            return None  # what follows the closer is dropped, as whitespace is between objects
        stripped = rest.lstrip()
        if not stripped:
            return None
        skipped = len(rest) - len(stripped)
        if self._state == "start":
            opener = next((o for o in self._openers if stripped.startswith(o)), None)
            if opener is None:
                if any(o.startswith(stripped) for o in self._openers):
                    return None  # may still become an opener
                return self._to_text()
            self._pos += skipped + (len(opener) if opener != "{" else 0)
            self._state = "between"
            return []
        if self._state == "between":
            if self._calls and stripped.startswith(self._separator):
                self._pos += skipped + len(self._separator)
                return []
            if self._closer is not None and stripped.startswith(self._closer):
                self._pos = len(self._text)
                self._state = "done"
                return []
            if not stripped.startswith("{"):
                return self._to_text()
            self._pos += skipped
            self._object.start(self._pos)
            self._state = "object"
            return []
        end = self._object.scan(self._text)  # state "object"
        if end is None:
            return None
        try:
            call = call_from_object(json.loads(self._text[self._pos : end]), self._arguments_keys)
        except ValueError:
            call = None
        if call is None:
            return self._to_text()
        self._pos, self._state = end, "between"
        index, self._calls = self._calls, self._calls + 1
        return [CallStart(index, call[0]), CallArguments(index, call[1])]


def llama3_json_parser() -> JsonSequenceParser:
    return JsonSequenceParser((PYTHON_TAG, "{"), ";", None, ("parameters", "arguments"))


def required_parser() -> JsonSequenceParser:
    """The array of the `required` tool choice's schema (data_plane/api/tool_calls.py)."""
    return JsonSequenceParser(("[",), ",", "]", ("parameters",))


class NamedParser:
    """A named tool choice: the whole output is that function's arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._held = ""  # leading whitespace, reported once the arguments begin
        self._started = False

    def feed(self, text: str) -> list[Event]:
        if self._started:
            return [CallArguments(0, text)] if text else []
        self._held += text
        if not self._held.strip():
            return []
        self._started = True
        arguments, self._held = self._held.lstrip(), ""
        return [CallStart(0, self._name), CallArguments(0, arguments)]

    def finish(self) -> list[Event]:
        return []
