"""Tool calls read out of generated text: pure functions of the text, whole or piece by piece.

`TOOL_CALL_PARSERS` names the formats `--tool-call-parser` accepts; each entry makes a fresh parser (one
per generated sequence). base.py states the events a parser reports.
"""

from __future__ import annotations

from collections.abc import Callable

from data_plane.api.tool_parsers.base import (
    CallArguments,
    CallStart,
    Event,
    ParsedCall,
    ParsedOutput,
    Text,
    ToolParser,
    collect,
    parse,
)
from data_plane.api.tool_parsers.hermes import HermesParser
from data_plane.api.tool_parsers.json_calls import NamedParser, llama3_json_parser, required_parser

TOOL_CALL_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": llama3_json_parser,
}

__all__ = [
    "TOOL_CALL_PARSERS",
    "CallArguments",
    "CallStart",
    "Event",
    "NamedParser",
    "ParsedCall",
    "ParsedOutput",
    "Text",
    "ToolParser",
    "collect",
    "parse",
    "required_parser",
]
