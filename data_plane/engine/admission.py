"""What an engine refuses before a request reaches its core, so that a request is admitted whole or not at all.

One API request may make several engine Requests (a completion's prompts, n samples each): the engines'
`submit` checks them together, here, and queues all of them or none, before any step. A refusal names the
limit and the figures:

    400  it can never fit: its sequences (prompts x n) exceed --max-waiting-requests, the tokens they may
         reach (prompt + max_tokens each) exceed --max-request-tokens, or one prompt breaks a per-prompt limit
    503  it would fit, but the waiting queue has no room for it now

The engine core adds its own refusals (KV cache, LoRA slots) when the group arrives, for all of it at once.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from data_plane.config import EngineConfig
from data_plane.engine.sampling_params import SamplingParams
from data_plane.engine.sequence import Request
from shared.errors import InvalidRequestError, OverloadedError


def check_limits(params: SamplingParams, config: EngineConfig) -> None:
    """The engine's per-prompt limits (--max-n, --max-stop-strings, --max-stop-string-length):
    one prompt may not take every slot of a step or make every step scan thousands of strings."""
    assert config.max_n is not None  # EngineConfig.__post_init__ fills it in
    if params.n > config.max_n:
        raise InvalidRequestError(f"n must be at most {config.max_n} on this engine (--max-n).", param="n")
    if len(params.stop) > config.max_stop_strings:
        raise InvalidRequestError(
            f"At most {config.max_stop_strings} stop strings are allowed (--max-stop-strings).", param="stop"
        )
    if any(len(s) > config.max_stop_string_length for s in params.stop):
        raise InvalidRequestError(
            f"Stop strings must be at most {config.max_stop_string_length} characters (--max-stop-string-length).",
            param="stop",
        )


def validate_request(request: Request, config: EngineConfig, vocab_size: int) -> None:
    """What one engine Request can never be served with, from the config and the vocabulary alone (→ 400)."""
    prompt_len = len(request.prompt_token_ids)
    max_len = config.max_model_len
    assert max_len is not None, "finalize the config (load the engine) first"
    if prompt_len == 0:
        raise InvalidRequestError("The prompt is empty.", param="prompt")
    check_limits(request.sampling_params, config)
    if prompt_len + request.sampling_params.max_tokens > max_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{prompt_len + request.sampling_params.max_tokens} tokens ({prompt_len} in the prompt, "
            f"{request.sampling_params.max_tokens} in the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens" if prompt_len < max_len else "prompt",
            code="context_length_exceeded",
        )
    if min(request.prompt_token_ids) < 0 or max(request.prompt_token_ids) >= vocab_size:
        raise InvalidRequestError(f"Prompt token ids must be in [0, {vocab_size}).", param="prompt")
    if any(t >= vocab_size for t in request.sampling_params.logit_bias or ()):
        raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab_size}).", param="logit_bias")


def _shape(requests: Sequence[Request]) -> str:
    """'64 prompts × n=128' (the group's requests share their sampling parameters)."""
    prompts = len(requests)
    return f"{prompts} prompt{'s' if prompts > 1 else ''} × n={requests[0].sampling_params.n}"


def check_group(requests: Sequence[Request], waiting_seqs: int, config: EngineConfig,
                in_flight: Container[str]) -> int:
    """Refuse the API request made of `requests` (400 never fits, 503 not now), or answer how many
    sequences it queues. `waiting_seqs`: those queued already, `in_flight`: request ids in use."""
    seqs = sum(r.sampling_params.n for r in requests)
    limit = config.max_waiting_requests
    if seqs > limit:
        raise InvalidRequestError(
            f"{_shape(requests)} = {seqs} sequences; this engine admits at most {limit} waiting "
            "(--max-waiting-requests). Send fewer prompts or a smaller n per request.",
            param="n" if len(requests) == 1 else "prompt",
        )
    tokens = sum(r.sampling_params.n * (len(r.prompt_token_ids) + r.sampling_params.max_tokens) for r in requests)
    assert config.max_request_tokens is not None, "finalize the config (load the engine) first"
    if tokens > config.max_request_tokens:
        raise InvalidRequestError(
            f"{_shape(requests)} = {seqs} sequences of prompt + max_tokens = {tokens} tokens; this engine takes at "
            f"most {config.max_request_tokens} tokens per request (--max-request-tokens). Send fewer prompts, a "
            "smaller n or a smaller max_tokens.",
            param="max_tokens",
        )
    seen: set[str] = set()
    for request in requests:
        if request.request_id in in_flight or request.request_id in seen:
            raise InvalidRequestError(f"Request id {request.request_id!r} is already in use.")
        seen.add(request.request_id)
    if waiting_seqs + seqs > limit:
        raise OverloadedError(
            f"The server is overloaded: {_shape(requests)} = {seqs} sequences, and the queue holds at most {limit} "
            f"waiting sequences (--max-waiting-requests) of which {waiting_seqs} are taken. Retry later."
        )
    return seqs
