"""POST /v1/chat/completions: render the conversation, run one engine Request (n samples), and
answer with a chat.completion object or a stream of chat.completion.chunk events."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from data_plane.adapters.entry import Lease
from data_plane.api.generation import Generation, start_generation
from data_plane.api.logprobs import LogprobFormatter
from data_plane.api.models import ModelResolver
from data_plane.api.prompts import check_prompt_chars, off_loop
from data_plane.api.protocol import ChatCompletionRequest
from data_plane.api.streaming import EventStream, event_stream, new_id, now_s, usage
from data_plane.api.tool_calls import ChoiceCalls, ToolPlan, deltas, message
from data_plane.engine.protocol import EngineProtocol
from data_plane.engine.sequence import Request
from data_plane.metrics import EngineMetrics
from data_plane.structured.compiler import GrammarCompiler
from shared.errors import LoraplaneError


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatService:
    def __init__(
        self, engine: EngineProtocol, resolver: ModelResolver, metrics: EngineMetrics, grammars: GrammarCompiler
    ) -> None:
        self.engine = engine
        self.grammars = grammars
        self.tokenizer = engine.tokenizer
        max_model_len = engine.config.max_model_len
        assert max_model_len is not None  # EngineProtocol.config is finalized
        self.max_model_len: int = max_model_len
        self.resolver = resolver
        self.metrics = metrics
        config = engine.config
        self.auto_tool_parser = config.tool_call_parser if config.enable_auto_tool_choice else None

    async def create(self, req: ChatCompletionRequest) -> dict[str, Any] | EventStream:
        """The response body, or an EventStream when req.stream; engine refusals raise (→ 4xx/5xx)."""
        arrival = time.monotonic()
        try:
            req.check()
            tools = req.tool_plan(self.auto_tool_parser)
            conversation = req.conversation()
            chars = sum(len(m["content"]) for m in conversation)
            limit = self.engine.config.max_prompt_chars
            assert limit is not None  # EngineProtocol.config is finalized
            check_prompt_chars(chars, limit, "messages")
            lease = await self.resolver.acquire(req.model)
        except LoraplaneError:
            # no adapter label here: the name may be one we do not serve (unbounded label values)
            self.metrics.start_request(arrival).finish("rejected")
            raise
        metrics = self.metrics.start_request(arrival, adapter=req.model)
        try:
            request = await self._engine_request(req, conversation, tools, lease)
        except Exception as exc:
            lease.release()
            metrics.finish("rejected" if isinstance(exc, LoraplaneError) else "error")
            raise
        generation = await start_generation(self.engine, request, metrics, lease)  # owns the lease now
        ctx = _Context(req, tools, request.request_id, request.prompt_token_ids, LogprobFormatter(self.tokenizer))
        if req.stream:
            return event_stream(_chunks(generation, ctx), generation.aclose)
        try:
            return await _collect(generation, ctx)
        finally:
            await generation.aclose()

    def _render(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        prompt = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tools=tools)
        return self.tokenizer.encode(prompt)  # the template already holds any BOS token

    async def _engine_request(
        self, req: ChatCompletionRequest, conversation: list[dict[str, Any]], tools: ToolPlan, lease: Lease
    ) -> Request:
        prompt_ids = await off_loop(self._render, conversation, tools.template_tools())
        params = req.to_sampling_params(default_max_tokens=max(1, self.max_model_len - len(prompt_ids)))
        tools.constrain(params)
        param = "tools" if tools.constrains else req.structured_param  # the field a compile refusal names
        grammar = await self.grammars.grammar_of(params.structured_outputs, param)
        request = Request(
            new_id("chatcmpl"),
            prompt_ids,
            params,
            adapter_id=lease.adapter_id,
            prefix_hash_seed=lease.cache_namespace,
            lora=lease.weights,
            grammar=grammar,
        )
        lease.bind(request.request_id)
        return request


@dataclass
class _Context:
    req: ChatCompletionRequest
    tools: ToolPlan
    request_id: str
    prompt_token_ids: list[int]
    formatter: LogprobFormatter
    created: int = field(default_factory=now_s)

    @property
    def top_n(self) -> int:
        return self.req.top_logprobs or 0

    def header(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.req.model}


async def _collect(generation: Generation, ctx: _Context) -> dict[str, Any]:
    n = ctx.req.n or 1
    choices = [_Choice() for _ in range(n)]
    cached = 0
    async for output in generation:
        cached = max(cached, output.num_cached_tokens)
        for d in output.deltas:
            c = choices[d.index]
            c.text += d.text
            c.token_ids += d.token_ids
            c.logprobs += d.logprobs or []
            if d.finish_reason is not None:
                c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
    body = ctx.header("chat.completion")
    body["choices"] = [_choice_body(i, c, ctx) for i, c in enumerate(choices)]
    body["usage"] = usage(len(ctx.prompt_token_ids), sum(len(c.token_ids) for c in choices), cached)
    if ctx.req.return_token_ids:
        body["prompt_token_ids"] = ctx.prompt_token_ids
    return body


def _choice_body(index: int, c: _Choice, ctx: _Context) -> dict[str, Any]:
    logprobs = None
    if ctx.req.logprobs:
        logprobs = {"content": ctx.formatter.chat(c.token_ids, c.logprobs, ctx.top_n)}
    body, calls = message(ctx.tools, c.text)
    choice: dict[str, Any] = {
        "index": index,
        "message": body,
        "logprobs": logprobs,
        "finish_reason": c.finish_reason if calls is None else calls.finish_reason(c.finish_reason),
        "stop_reason": c.stop_reason,
    }
    if ctx.req.return_token_ids:
        choice["token_ids"] = c.token_ids
    return choice


async def _chunks(generation: Generation, ctx: _Context) -> AsyncIterator[dict[str, Any]]:
    req = ctx.req
    header = ctx.header("chat.completion.chunk")  # per chunk: built once, not per token
    continuous_usage, include_usage = req.continuous_usage, req.include_usage

    completion_tokens = cached = 0

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        body = {**header, "choices": [choice]}
        if continuous_usage:
            body["usage"] = usage(len(ctx.prompt_token_ids), completion_tokens, cached)
        elif include_usage:
            body["usage"] = None  # only the final chunk carries usage
        return body

    # OpenAI opens every choice with a chunk that carries only the role
    for index in range(req.n or 1):
        first = chunk(
            {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        )
        if req.return_token_ids and index == 0:
            first["prompt_token_ids"] = ctx.prompt_token_ids
        yield first
    calls = [ChoiceCalls(ctx.tools) for _ in range(req.n or 1)] if ctx.tools.parses else None
    async for output in generation:
        cached = max(cached, output.num_cached_tokens)
        for d in output.deltas:
            completion_tokens += len(d.token_ids)
            if not d.text and not d.token_ids and d.finish_reason is None:
                continue
            finish_reason = d.finish_reason
            if calls is None:
                pieces = [{"content": d.text} if d.text else {}]
            else:  # the text read for tool calls: content and call pieces, some held back until more comes
                c = calls[d.index]
                events = c.feed(d.text) + (c.finish() if d.finish_reason is not None else [])
                pieces = deltas(events) or [{}]
                finish_reason = c.finish_reason(d.finish_reason)
                if pieces == [{}] and finish_reason is None and not (req.logprobs or req.return_token_ids):
                    continue  # nothing to show yet
            for i, delta in enumerate(pieces):  # the first piece carries the tokens, the last the finish
                is_first, is_last = i == 0, i == len(pieces) - 1
                choice: dict[str, Any] = {
                    "index": d.index,
                    "delta": delta,
                    "logprobs": {"content": ctx.formatter.chat(d.token_ids, d.logprobs or [], ctx.top_n)}
                    if req.logprobs and is_first
                    else None,
                    "finish_reason": finish_reason if is_last else None,
                }
                if is_last and finish_reason is not None:
                    choice["stop_reason"] = d.stop_reason
                if req.return_token_ids:
                    choice["token_ids"] = d.token_ids if is_first else []
                yield chunk(choice)
    if include_usage:
        yield {
            **header,
            "choices": [],
            "usage": usage(len(ctx.prompt_token_ids), completion_tokens, cached),
        }
