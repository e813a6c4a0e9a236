"""Per-request sampling parameters, validated once at the API edge."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from data_plane.structured.constraint import Constraint
from shared.errors import InvalidRequestError

# vLLM's and OpenAI's seed is a signed 64-bit integer; torch generators take [-2**63, 2**64 - 1].
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
# OpenAI's range of a logit bias: -100 effectively bans a token, +100 effectively forces it.
LOGIT_BIAS_LIMIT = 100.0


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed`: distinct per sample and always in
    [0, 2**64), the range torch's generator accepts, however close `seed` is to the bounds."""
    return (seed + index) % 2**64


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's `structured_outputs`): exactly one of the fields is set.

    json: a JSON schema, as compact JSON text; json_object: any JSON object; regex: a regular expression
    the whole output matches; choice: the output is one of these strings; grammar: a Lark grammar.
    The API process checks and compiles it (data_plane/structured/); the engine core holds one matcher per
    constrained sequence and masks that row's logits before sampling.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = sum(v is not None for v in (self.json, self.regex, self.choice, self.grammar))
        if given + self.json_object != 1:
            raise InvalidRequestError(
                "structured_outputs takes exactly one of json, json_object, regex, choice and grammar.",
                param="structured_outputs",
            )

    def constraint(self) -> Constraint:
        """The constraint as text, what the grammar compiler and its cache take."""
        if self.json is not None:
            return Constraint("json", self.json)
        if self.regex is not None:
            return Constraint("regex", self.regex)
        if self.choice is not None:
            return Constraint("choice", json.dumps(self.choice, ensure_ascii=False))
        if self.grammar is not None:
            return Constraint("grammar", self.grammar)
        return Constraint("json_object", "")


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token; None = off
    # token id -> bias added to that token's logit before sampling (greedy included); ids are checked
    # against the vocabulary at admission (data_plane/engine/admission.py)
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # None: unconstrained

    def __post_init__(self) -> None:
        if self.top_k == 0:
            self.top_k = -1
        checks: list[tuple[bool, str, str]] = [
            (self.n >= 1, "n", "n must be at least 1"),
            (self.max_tokens >= 1, "max_tokens", "max_tokens must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", "min_tokens must be non-negative"),
            (self.min_tokens <= self.max_tokens, "min_tokens", "min_tokens must not exceed max_tokens"),
            (self.temperature >= 0.0, "temperature", "temperature must be non-negative"),
            (0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "top_k must be -1 (disabled) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "repetition_penalty must be in (0, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "logprobs must be between 0 and 20"),
            (
                self.seed is None or SEED_MIN <= self.seed <= SEED_MAX,
                "seed",
                f"seed must be between {SEED_MIN} and {SEED_MAX} (a signed 64-bit integer)",
            ),
        ]
        bias = self.logit_bias or {}
        checks.append((
            all(t >= 0 and -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT for t, b in bias.items()),
            "logit_bias",
            "logit_bias maps non-negative token ids to biases in [-100, 100]",
        ))
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)
