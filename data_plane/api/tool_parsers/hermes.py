"""`hermes`: calls written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5 and
Qwen3, Hermes 2 Pro and others whose chat templates list the tools in the system prompt).

Text before, between and after the blocks is content; whitespace alone after a call is not. A block
whose body is not such an object is left in the content as written. A block the generation ended
inside (no closing tag) is still a call when its body is a complete one, as vLLM's parser takes it.
"""

from __future__ import annotations

import json

from data_plane.api.tool_parsers.base import (
    CallArguments,
    CallStart,
    Event,
    Text,
    call_from_object,
    held_prefix,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser:
    def __init__(self) -> None:
        self._buffer = ""  # text not yet reported: a block being written, or what may begin "<tool_call>"
        self._inside = False
        self._calls = 0
        self._gap = ""  # whitespace after a call, reported only if more text follows it

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    return events
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE) :]
                self._inside = False
                events += self._block(body, OPEN + body + CLOSE)
                continue
            begin = self._buffer.find(OPEN)
            if begin < 0:
                keep = held_prefix(self._buffer, OPEN)
                ready, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep :]
                events += self._text(ready)
                return events
            events += self._text(self._buffer[:begin], before_block=True)
            self._buffer = self._buffer[begin + len(OPEN) :]
            self._inside = True

    def finish(self) -> list[Event]:
        rest, self._buffer = self._buffer, ""
        if self._inside:
            self._inside = False
            return self._block(rest, OPEN + rest)
        return self._text(rest, before_block=True)

    def _text(self, text: str, before_block: bool = False) -> list[Event]:
        """Content, except whitespace alone after a call (held in case text follows, dropped otherwise)."""
        if self._calls == 0:
            return [Text(text)] if text else []
        if text.strip():
            text, self._gap = self._gap + text, ""
            return [Text(text)]
        self._gap = "" if before_block else self._gap + text
        return []

    def _block(self, body: str, written: str) -> list[Event]:
        try:
            call = call_from_object(json.loads(body), ("arguments", "parameters"))
        except ValueError:
            call = None
        if call is None:
            return self._text(written)
        self._gap = ""
        index, self._calls = self._calls, self._calls + 1
        return [CallStart(index, call[0]), CallArguments(index, call[1])]
