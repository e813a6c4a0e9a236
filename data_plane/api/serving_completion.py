"""POST /v1/completions: one engine Request per prompt (n samples each), admitted together as one group
(the engine checks prompts x n against its limits and shares its batch fairly per group), answered as a
text_completion object or a stream of text_completion chunks. Choice i*n + j is sample j of prompt i."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from data_plane.adapters.entry import Lease
from data_plane.api.generation import MergedGenerations, start_all
from data_plane.api.logprobs import LogprobFormatter, merge_completion_logprobs
from data_plane.api.models import ModelResolver
from data_plane.api.prompts import check_prompt_chars, off_loop
from data_plane.api.protocol import CompletionRequest
from data_plane.api.streaming import EventStream, event_stream, new_id, now_s, usage
from data_plane.engine.outputs import CompletionDelta
from data_plane.engine.protocol import EngineProtocol
from data_plane.engine.sequence import Request
from data_plane.metrics import EngineMetrics
from data_plane.structured.compiler import GrammarCompiler
from shared.errors import InvalidRequestError, LoraplaneError

MAX_BATCH_PROMPTS = 64  # a batched request is admitted all at once; keep one client from filling the queue


@dataclass
class _Choice:
    prompt_index: int
    text: str = ""  # includes the echoed prompt
    token_ids: list[int] = field(default_factory=list)
    logprobs: dict[str, list[Any]] | None = None
    text_offset: int = 0  # where the next token's text starts (legacy logprobs)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionService:
    def __init__(
        self, engine: EngineProtocol, resolver: ModelResolver, metrics: EngineMetrics, grammars: GrammarCompiler
    ) -> None:
        self.engine = engine
        self.grammars = grammars
        self.tokenizer = engine.tokenizer
        self.resolver = resolver
        self.metrics = metrics

    async def create(self, req: CompletionRequest) -> dict[str, Any] | EventStream:
        arrival = time.monotonic()
        response_id = new_id("cmpl")
        try:
            prompts = self._prompts(req)
            leases = await self.resolver.acquire_many(req.model, len(prompts))
        except LoraplaneError:
            self.metrics.start_request(arrival).finish("rejected")  # unresolved name: no adapter label
            raise
        try:
            requests = await self._engine_requests(req, prompts, leases, response_id)
        except Exception as exc:
            for lease in leases:
                lease.release()
            self.metrics.start_request(arrival, adapter=req.model).finish(
                "rejected" if isinstance(exc, LoraplaneError) else "error"
            )
            raise
        try:
            generations = await start_all(
                self.engine,
                [(r, self.metrics.start_request(arrival, adapter=req.model), lease) for r, lease in zip(requests, leases, strict=True)],
            )
        except BaseException:
            for lease in leases:  # idempotent; covers requests cancelled before they even started
                lease.release()
            raise
        merged = MergedGenerations(generations)
        ctx = _Context(
            req, response_id, [r.prompt_token_ids for r in requests], LogprobFormatter(self.tokenizer)
        )
        ctx.init_choices(self.tokenizer)
        if req.stream:
            return event_stream(_chunks(merged, ctx), merged.aclose)
        try:
            async for prompt_index, output in merged:
                ctx.cached = max(ctx.cached, output.num_cached_tokens)
                for d in output.deltas:
                    ctx.apply(prompt_index, d)
            return _body(ctx)
        finally:
            await merged.aclose()

    def _prompts(self, req: CompletionRequest) -> list[str | list[int]]:
        req.check()
        prompts = req.prompts()
        if len(prompts) > MAX_BATCH_PROMPTS:
            raise InvalidRequestError(f"At most {MAX_BATCH_PROMPTS} prompts per request.", param="prompt")
        limit = self.engine.config.max_prompt_chars
        assert limit is not None  # EngineProtocol.config is finalized
        for prompt in prompts:
            if isinstance(prompt, str):
                check_prompt_chars(len(prompt), limit, "prompt")
        return prompts

    def _encode_all(self, prompts: list[str | list[int]]) -> list[list[int]]:
        return [self.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else p for p in prompts]

    async def _engine_requests(
        self, req: CompletionRequest, prompts: list[str | list[int]], leases: list[Lease], response_id: str
    ) -> list[Request]:
        params = req.to_sampling_params()
        grammar = await self.grammars.grammar_of(params.structured_outputs, req.structured_param)
        # token ids need no tokenizer: only text goes to the tokenizer threads (a hop per request otherwise)
        text = any(isinstance(p, str) for p in prompts)
        encoded = (
            await off_loop(self._encode_all, prompts) if text else [p for p in prompts if not isinstance(p, str)]
        )
        requests = []
        for i, (ids, lease) in enumerate(zip(encoded, leases, strict=True)):
            request_id = response_id if len(prompts) == 1 else f"{response_id}-{i}"
            requests.append(
                Request(
                    request_id,
                    ids,
                    params,
                    adapter_id=lease.adapter_id,
                    prefix_hash_seed=lease.cache_namespace,
                    lora=lease.weights,
                    group_id=response_id if len(prompts) > 1 else "",
                    grammar=grammar,
                )
            )
            lease.bind(request_id)
        return requests


@dataclass
class _Context:
    req: CompletionRequest
    response_id: str
    prompt_token_ids: list[list[int]]
    formatter: LogprobFormatter
    created: int = field(default_factory=now_s)
    choices: list[_Choice] = field(default_factory=list)
    cached: int = 0

    @property
    def n(self) -> int:
        return self.req.n or 1

    def init_choices(self, tokenizer: Any) -> None:
        for p, ids in enumerate(self.prompt_token_ids):
            echo = tokenizer.decode(ids, skip_special_tokens=False) if self.req.echo else ""
            self.choices += [_Choice(p, text=echo, text_offset=len(echo)) for _ in range(self.n)]

    def apply(self, prompt_index: int, d: CompletionDelta) -> tuple[int, dict[str, list[Any]] | None]:
        """Add a delta to its choice; returns the choice index and the delta's legacy logprobs."""
        index = prompt_index * self.n + d.index
        c = self.choices[index]
        c.text += d.text
        c.token_ids += d.token_ids
        logprobs = None
        if self.req.logprobs is not None:
            logprobs, c.text_offset = self.formatter.completion(d.token_ids, d.logprobs or [], c.text_offset)
            c.logprobs = merge_completion_logprobs(c.logprobs, logprobs)
        if d.finish_reason is not None:
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        return index, logprobs

    def header(self) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.req.model,
        }

    def usage(self) -> dict[str, Any]:
        prompt_tokens = sum(len(ids) for ids in self.prompt_token_ids)
        return usage(prompt_tokens, sum(len(c.token_ids) for c in self.choices), self.cached)


def _body(ctx: _Context) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(ctx.choices):
        empty_logprobs: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        choice: dict[str, Any] = {
            "index": i,
            "text": c.text,
            "logprobs": (c.logprobs or empty_logprobs) if ctx.req.logprobs is not None else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if ctx.req.return_token_ids:
            choice["prompt_token_ids"] = ctx.prompt_token_ids[c.prompt_index]
            choice["token_ids"] = c.token_ids
        choices.append(choice)
    return {**ctx.header(), "choices": choices, "usage": ctx.usage()}


async def _chunks(merged: MergedGenerations, ctx: _Context) -> AsyncIterator[dict[str, Any]]:
    req = ctx.req
    header = ctx.header()  # per chunk: built once, not per token
    continuous_usage, include_usage = req.continuous_usage, req.include_usage

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        body = {**header, "choices": [choice]}
        if continuous_usage:
            body["usage"] = ctx.usage()  # the usage so far (vLLM's continuous_usage_stats)
        elif include_usage:
            body["usage"] = None
        return body

    if req.echo or req.return_token_ids:  # echoed prompt / prompt ids go first, once per choice
        for i, c in enumerate(ctx.choices):
            first: dict[str, Any] = {"index": i, "text": c.text, "logprobs": None, "finish_reason": None}
            if req.return_token_ids:
                first["prompt_token_ids"] = ctx.prompt_token_ids[c.prompt_index]
                first["token_ids"] = []
            yield chunk(first)
    async for prompt_index, output in merged:
        ctx.cached = max(ctx.cached, output.num_cached_tokens)
        for d in output.deltas:
            index, logprobs = ctx.apply(prompt_index, d)
            if not d.text and not d.token_ids and d.finish_reason is None:
                continue
            choice: dict[str, Any] = {
                "index": index,
                "text": d.text,
                "logprobs": logprobs,
                "finish_reason": d.finish_reason,
            }
            if d.finish_reason is not None:
                choice["stop_reason"] = d.stop_reason
            if req.return_token_ids:
                choice["token_ids"] = d.token_ids
            yield chunk(choice)
    if include_usage:
        yield {**header, "choices": [], "usage": ctx.usage()}
