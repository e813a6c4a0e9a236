"""Tool calling on /v1/chat/completions, in OpenAI's shape and as vLLM serves it.

A request's `tools` go into the chat template whatever its `tool_choice`; what happens to the output
depends on the choice (`ToolPlan`):
- "none": nothing is parsed; the output is content.
- "auto" (the default when `tools` are given): the `--tool-call-parser` format is read out of the
  output (needs `--enable-auto-tool-choice`, else 400 as vLLM's).
- "required": the output is constrained to a JSON array of calls (`required_schema`), parsed into calls.
- a named function: the output is constrained to that function's parameters schema, and is its arguments.
finish_reason is "tool_calls" when calls were made and the generation stopped by itself, except for a
named choice (OpenAI's "stop").
"""

from __future__ import annotations

import copy
import json
import secrets
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from data_plane.api.tool_parsers import (
    TOOL_CALL_PARSERS,
    CallArguments,
    CallStart,
    Event,
    NamedParser,
    ToolParser,
    collect,
    required_parser,
)
from data_plane.engine.sampling_params import SamplingParams, StructuredOutputsParams
from shared.errors import InvalidRequestError

FunctionName = Annotated[str, Meta(pattern="^[a-zA-Z0-9_-]{1,64}$", description="letters, digits, _ and -; 1-64")]


class FunctionDefinition(msgspec.Struct, omit_defaults=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(msgspec.Struct, omit_defaults=True):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


def template_tool_calls(calls: list[ToolCall], param: str) -> list[dict[str, Any]]:
    """An assistant message's calls as chat templates take them: arguments decoded into an object
    (as vLLM hands them to Hugging Face templates)."""
    out = []
    for i, call in enumerate(calls):
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise InvalidRequestError(
                "A tool call's arguments must be the JSON text of an object.",
                param=f"{param}[{i}].function.arguments",
            )
        function = {"name": call.function.name, "arguments": arguments}
        out.append({"id": call.id, "type": call.type, "function": function})
    return out


def _parameters(tool: Tool) -> dict[str, Any]:
    """A tool's parameters schema, `{"type": "object", "properties": {}}` when it gives none (vLLM's)."""
    params = tool.function.parameters
    if not params:
        return {"type": "object", "properties": {}}
    copied: dict[str, Any] = copy.deepcopy(params)
    return copied


def required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """vLLM's schema of a `required` choice: an array of at least one (exactly one unless `parallel`)
    `{"name": <a tool's name>, "parameters": <that tool's parameters>}`; each tool's `$defs` are moved to
    the top, where its `#/$defs/...` references point."""
    variants = []
    defs: dict[str, Any] = {}
    for tool in tools:
        params = _parameters(tool)
        tool_defs = params.pop("$defs", {})
        if not isinstance(tool_defs, dict):
            raise InvalidRequestError(f"`$defs` of tool {tool.function.name!r} must be an object.", param="tools")
        for name, definition in tool_defs.items():
            if defs.setdefault(name, definition) != definition:
                raise InvalidRequestError(f"Tools define `$defs` {name!r} differently.", param="tools")
        variants.append({
            "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": params},
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass(frozen=True)
class ToolPlan:
    """What one request's tools mean: for the template, the constraint and the output."""

    mode: Literal["off", "none", "auto", "required", "named"]
    tools: list[Tool]
    parallel: bool = True
    name: str | None = None  # the named choice's function
    parser_name: str | None = None  # auto's --tool-call-parser

    @classmethod
    def of(
        cls,
        tools: list[Tool] | None,
        choice: ToolChoice | None,
        parallel_tool_calls: bool | None,
        auto_parser: str | None,
    ) -> ToolPlan:
        """Check the request's tool fields (400s naming them, as vLLM's); auto_parser: the engine's
        --tool-call-parser when --enable-auto-tool-choice is on, else None."""
        if tools is not None and not tools:
            raise InvalidRequestError(
                "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
                param="tools",
            )
        names = [t.function.name for t in tools or []]
        if len(set(names)) != len(names):
            raise InvalidRequestError("Tool function names must be unique.", param="tools")
        parallel = parallel_tool_calls is not False
        if choice is None:
            choice = "auto" if tools else "none"
        if choice == "none":
            return cls("none" if tools else "off", tools or [], parallel)
        if tools is None:
            raise InvalidRequestError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise InvalidRequestError(
                    f"The tool specified in `tool_choice` ({choice.function.name!r}) does not match any of the "
                    "specified `tools`.",
                    param="tool_choice",
                )
            return cls("named", tools, parallel, name=choice.function.name)
        if choice == "required":
            return cls("required", tools, parallel)
        if auto_parser is None:
            raise InvalidRequestError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set.',
                param="tool_choice",
            )
        return cls("auto", tools, parallel, parser_name=auto_parser)

    @property
    def parses(self) -> bool:
        return self.mode in ("auto", "required", "named")

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template gets them (the request's objects), None without tools."""
        return [msgspec.to_builtins(t) for t in self.tools] if self.tools else None

    @property
    def constrains(self) -> bool:
        """Whether the choice constrains the output (required or named)."""
        return self.mode in ("required", "named")

    def constrain(self, params: SamplingParams) -> None:
        """Set the constraint of a required or named choice on params (400 if they already carry one)."""
        if self.mode == "required":
            schema = required_schema(self.tools, self.parallel)
        elif self.mode == "named":
            schema = _parameters(next(t for t in self.tools if t.function.name == self.name))
        else:
            return
        if params.structured_outputs is not None:
            raise InvalidRequestError(
                "You can only either use constraints for structured outputs or tools, not both.",
                param="tool_choice",
            )
        params.structured_outputs = StructuredOutputsParams(json=json.dumps(schema, ensure_ascii=False))

    def parser(self) -> ToolParser | None:
        """A fresh parser for one generated sequence; None when calls are not read ("none", no tools)."""
        if self.mode == "auto":
            assert self.parser_name is not None
            return TOOL_CALL_PARSERS[self.parser_name]()
        if self.mode == "required":
            return required_parser()
        if self.mode == "named":
            assert self.name is not None
            return NamedParser(self.name)
        return None


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ChoiceCalls:
    """One choice's output through the plan's parser: events as its text streams in, the calls it made."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        parser = plan.parser()
        assert parser is not None, "only for plans that parse"
        self._parser: ToolParser = parser
        self.made = False

    def feed(self, text: str) -> list[Event]:
        return self._keep(self._parser.feed(text))

    def finish(self) -> list[Event]:
        return self._keep(self._parser.finish())

    def _keep(self, events: list[Event]) -> list[Event]:
        """Without parallel_tool_calls, only the first call (as vLLM)."""
        if not self.plan.parallel:
            events = [e for e in events if not isinstance(e, CallStart | CallArguments) or e.index == 0]
        self.made = self.made or any(isinstance(e, CallStart) for e in events)
        return events

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if self.made and self.plan.mode != "named" and engine_reason == "stop":
            return "tool_calls"
        return engine_reason


def message(plan: ToolPlan, text: str) -> tuple[dict[str, Any], ChoiceCalls | None]:
    """A whole choice's `message`, and its parse (None when the plan reads no calls)."""
    if not plan.parses:
        return {"role": "assistant", "content": text}, None
    calls = ChoiceCalls(plan)
    parsed = collect(calls.feed(text) + calls.finish())
    body: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        body["tool_calls"] = [
            {"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.calls
        ]
    return body, calls


def deltas(events: list[Event]) -> list[dict[str, Any]]:
    """Stream `delta`s in OpenAI's order: a call opens with its index, id, type, name and empty arguments;
    its argument pieces follow with the index only. Adjacent text goes in one content delta."""
    out: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, CallStart):
            opening = {"index": event.index, "id": new_call_id(), "type": "function"}
            out.append({"tool_calls": [{**opening, "function": {"name": event.name, "arguments": ""}}]})
        elif isinstance(event, CallArguments):
            if event.text:
                out.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})
        elif out and "content" in out[-1]:
            out[-1]["content"] += event.text
        elif event.text:
            out.append({"content": event.text})
    return out
