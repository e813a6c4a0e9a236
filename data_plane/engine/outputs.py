"""What the engine hands back to the API after each step: per-choice deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.errors import LoraplaneError


@dataclass
class CompletionDelta:
    """New output of one choice since the previous RequestOutput of its request."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per new token: {token_id: logprob}, sampled token first
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    deltas: list[CompletionDelta] = field(default_factory=list)
    finished: bool = False  # every choice of the request is finished
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine failed the request (internal detail: logged, not sent)
    client_error: LoraplaneError | None = None  # set when the client should read why (sent as is)
    # on the output that carries the request's first token: the engine steps from its arrival in the
    # engine through the one that sampled that token (1: admitted and sampled at the next step)
    first_token_steps: int | None = None
