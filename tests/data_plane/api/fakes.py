"""A scripted engine and tokenizer with the AsyncLLMEngine interface, for testing the HTTP layer
without a model: one character per token, outputs known in advance."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from data_plane.engine.outputs import CompletionDelta, RequestOutput
from data_plane.engine.sequence import Request
from data_plane.lora.errors import LoRAAdapterError
from data_plane.lora.slots import AdapterEngineStats, LoRAEngineStats
from data_plane.lora.weights import LoRAAdapterWeights
from shared.errors import InvalidRequestError, OverloadedError

MAX_MODEL_LEN = 64


class FakeTokenizer:
    """One token per character (id = code point), so texts and ids map trivially."""

    eos_token_ids = {0}
    vocab_size = 0x110000

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        text = "".join(f"{m['role']}:{m['content']}\n" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "")


@dataclass
class FakeConfig:
    max_model_len: int = MAX_MODEL_LEN
    served_model_name: str = "fake"
    model: str = "/models/fake"
    max_request_body_bytes: int = 4096
    max_prompt_chars: int = MAX_MODEL_LEN * 16
    max_n: int = 8
    max_stop_strings: int = 16
    max_stop_string_length: int = 256
    admin_token: str | None = None
    api_key: str | None = None
    enable_lora: bool = False
    max_cpu_loras: int = 4
    lora_modules: dict[str, str] = field(default_factory=dict)
    max_adapter_labels: int = 100
    default_drain_timeout_s: float = 30.0


@dataclass
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 8
    kv_blocks_used: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    lora: LoRAEngineStats | None = None


@dataclass
class FakeEngine:
    """Choice j of a request generates `reply` shifted by j ("abc…" → "bcd…" for j=1), one char per step."""

    reply: str = "hello world"
    step_delay: float = 0.0
    overloaded: bool = False
    fail_with: Exception | None = None  # raised on admission (tests the 500 path)
    error_after: int | None = None  # steps after which the output carries an engine error
    config: FakeConfig = field(default_factory=FakeConfig)
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    vocab_size: int = FakeTokenizer.vocab_size
    healthy: bool = True
    dead_reason: str | None = None
    started: bool = False
    requests: list[Request] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    # adapter interface: pins take a slot; abort() ends a running request at its next step
    lora_slots: int = 2
    pinned: set[int] = field(default_factory=set)
    removed: list[int] = field(default_factory=list)

    def start(self) -> None:
        asyncio.get_running_loop()  # like the real engine: must run inside the loop
        self.started = True

    async def shutdown(self) -> None:
        self.started = False

    def stats(self) -> FakeStats:
        adapters = {i: AdapterEngineStats(slot=n, pinned=True) for n, i in enumerate(sorted(self.pinned))}
        return FakeStats(
            num_running=len(self.requests) - len(self.aborted) - len(self.finished),
            lora=LoRAEngineStats(self.lora_slots, len(self.pinned), adapters),
        )

    async def pin_lora(self, adapter_id: int, weights: LoRAAdapterWeights) -> None:
        if len(self.pinned) >= self.lora_slots:
            raise LoRAAdapterError("every LoRA slot is pinned")
        self.pinned.add(adapter_id)

    async def unpin_lora(self, adapter_id: int) -> None:
        self.pinned.discard(adapter_id)

    async def remove_lora(self, adapter_id: int) -> None:
        self.pinned.discard(adapter_id)
        self.removed.append(adapter_id)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        params = request.sampling_params
        if self.fail_with is not None:
            raise self.fail_with
        if len(request.prompt_token_ids) + params.max_tokens > self.config.max_model_len:
            raise InvalidRequestError("prompt too long", param="prompt", code="context_length_exceeded")
        if self.overloaded:
            raise OverloadedError("The server is overloaded.")
        self.requests.append(request)
        done = False
        try:
            for step in range(params.max_tokens):
                if self.step_delay:
                    await asyncio.sleep(self.step_delay)
                else:
                    await asyncio.sleep(0)
                if request.request_id in self.aborted:  # like the engine: an aborted request ends now
                    done = True
                    deltas = [CompletionDelta(j, "", [], None, "abort") for j in range(params.n)]
                    yield RequestOutput(request.request_id, request.prompt_token_ids, deltas, finished=True)
                    return
                if self.error_after is not None and step >= self.error_after:
                    done = True
                    yield RequestOutput(
                        request.request_id, request.prompt_token_ids, finished=True, error="boom"
                    )
                    return
                last = step == params.max_tokens - 1
                deltas = [self._delta(j, step, last, params.logprobs) for j in range(params.n)]
                done = last
                yield RequestOutput(request.request_id, request.prompt_token_ids, deltas, finished=last)
        finally:
            if done:
                if request.request_id not in self.aborted:
                    self.finished.append(request.request_id)
            else:
                self.abort(request.request_id)

    def _delta(self, choice: int, step: int, last: bool, logprobs: int | None) -> CompletionDelta:
        char = chr(ord(self.reply[step % len(self.reply)]) + choice)
        token = ord(char)
        lp = None if logprobs is None else [{token: -0.5, ord("?"): -1.5, ord("!"): -2.5}]
        return CompletionDelta(choice, char, [token], lp, "length" if last else None)


def sample_sum(registry, name: str, **labels: str) -> float:
    """Sum of the samples `name` whose labels include `labels` (0 when there are none): the tests ask
    "how many ok requests" without caring which `adapter` label they carry."""
    total = 0.0
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
