"""Engine logprobs ({token_id: logprob} per generated token, sampled token first) in OpenAI shapes.

Chat uses the current format (`content: [{token, logprob, bytes, top_logprobs}]`), completions
the legacy one (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`). A token's text is
the token decoded on its own, so a token holding part of a UTF-8 character shows as U+FFFD, and
`bytes` is that text's UTF-8 (as vLLM does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

# JSON has no -inf; OpenAI reports impossible tokens with this value.
MIN_LOGPROB = -9999.0


class TokenDecoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def _clamp(logprob: float) -> float:
    return MIN_LOGPROB if math.isnan(logprob) else max(logprob, MIN_LOGPROB)


class LogprobFormatter:
    def __init__(self, tokenizer: TokenDecoder) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # token id -> text; a per-request cache

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode("utf-8"))}

    def chat(
        self, token_ids: Sequence[int], logprobs: Sequence[dict[int, float]], top_n: int
    ) -> list[dict[str, Any]]:
        """`logprobs.content` entries for the given generated tokens."""
        content = []
        for token_id, candidates in zip(token_ids, logprobs, strict=False):
            entry = self._entry(token_id, candidates.get(token_id, -math.inf))
            ranked = sorted(candidates.items(), key=lambda kv: kv[1], reverse=True)[:top_n]
            entry["top_logprobs"] = [self._entry(t, lp) for t, lp in ranked]
            content.append(entry)
        return content

    def completion(
        self, token_ids: Sequence[int], logprobs: Sequence[dict[int, float]], text_offset: int
    ) -> tuple[dict[str, list[Any]], int]:
        """Legacy logprobs for the given tokens whose text starts at `text_offset` in the choice's text;
        also returns the offset after them. top_logprobs holds the sampled token and the top-k, as vLLM."""
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for token_id, candidates in zip(token_ids, logprobs, strict=False):
            text = self.token_text(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(_clamp(candidates.get(token_id, -math.inf)))
            out["top_logprobs"].append({self.token_text(t): _clamp(lp) for t, lp in candidates.items()})
            out["text_offset"].append(text_offset)
            text_offset += len(text)
        return out, text_offset


def merge_completion_logprobs(
    into: dict[str, list[Any]] | None, more: dict[str, list[Any]]
) -> dict[str, list[Any]]:
    if into is None:
        return {k: list(v) for k, v in more.items()}
    for key, values in more.items():
        into[key].extend(values)
    return into
