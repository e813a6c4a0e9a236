"""Request and Sequence: all state of one request lives here, nowhere else."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from data_plane.engine.sampling_params import SamplingParams
from data_plane.lora.weights import LoRAAdapterWeights
from data_plane.structured.grammar import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; back in the waiting queue, recomputed on resume
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # client went away or the request was cancelled
    ERROR = "error"


@dataclass
class Request:
    """What the API hands the engine: one prompt, its sampling parameters and its adapter."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    adapter_id: int = 0  # 0 = base model; LoRA adapters get ids >= 1
    prefix_hash_seed: int = 0  # seed of the first KV block hash (the adapter's cache namespace)
    # the adapter's validated host weights; the engine copies them into a device slot when it schedules
    # the request (holding the reference keeps them alive even if the host cache drops them meanwhile)
    lora: LoRAAdapterWeights | None = None
    # the API request it belongs to when that one made several (a completion's prompts): the scheduler's
    # fair share is per group (scheduler.py); "" makes the request a group of its own
    group_id: str = ""
    # llguidance's grammar text of sampling_params.structured_outputs, compiled and checked by the API process
    # (data_plane/structured/compiler.py); None with a constraint: the engine derives it itself
    grammar: str | None = None

    @property
    def group(self) -> str:
        return self.group_id or self.request_id


@dataclass
class Sequence:
    """One sample of a request (n > 1 makes several), with its KV blocks and generated tokens."""

    seq_id: int
    request: Request
    index: int  # choice index within the request
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)  # per token: {token_id: logprob}
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (this schedule)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    generator: torch.Generator | None = None  # per-request seed: set by the engine when seed is given
    # where a constrained sequence stands in its grammar: advanced once per sampled token, so a recomputation
    # after preemption (which samples nothing it had sampled) leaves it where it was
    matcher: GrammarMatcher | None = None
    # Detokenizer state (see data_plane/engine/detokenizer.py)
    output_text: str = ""
    sent_text_offset: int = 0  # characters of output_text already returned to the client
    sent_token_offset: int = 0  # tokens of output_token_ids already returned to the client
    sent_finish: bool = False  # its finish was returned to the client
    detok_prefix_offset: int = 0
    detok_read_offset: int = 0
    detok_new_chars: int = 0  # characters the last token added to output_text

    @property
    def adapter_id(self) -> int:
        return self.request.adapter_id

    @property
    def sampling_params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.request.prompt_token_ids[-1]

    def __len__(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
