"""How many tokens of long prompts a step may compute beside running decodes.

Chunked prefill alone bounds a step by the token budget (`--max-num-batched-tokens`, 2048 as in vLLM).
On a GPU a 2,048-token chunk costs little more than a decode step; on a CPU it costs tens of decode
steps, so every running decode would wait that long for its next token. The pacer sizes the long
prompts' share of a step from what steps measurably cost on this machine, so that a step computing
chunks beside decodes takes at most `stall_limit` times a step of the decodes alone:

    t(step) ~ t_decode + c * P      P: prefill tokens in the step, c: seconds per prefill token
    P_long  = (stall_limit - 1) * t_decode / c

t_decode is the median of recent decode-only steps, c the median of recent (t(step) - t_decode) / P
over steps that computed prefill tokens beside decodes; medians, because one step stalled by the
machine (another process, a page fault) must not move the budget. A decode step grows dearer as its
sequences' contexts grow, so a t_decode from before a long prompt arrived would count that growth as
the prompt's cost: every PROBE_EVERY-th step beside a long prompt computes none of it, and measures
the decodes alone again. Until a decode-only step has been
seen the long share is `MIN_LONG_CHUNK`; until a step with both has been seen, c is taken as what
one decode token costs (t_decode / decodes), an overestimate, so the first chunks are small and grow.
The share at most doubles from one step to the next: an estimate of c from a few cheap steps, where
noise is most of the figure, cannot jump it to the whole token budget and stall the decodes at once.

The limit rises with how many long prompts wait for each running decode: a step may take up to
1 + (long prompts) / (decodes) times a decode-only step where that is above `stall_limit`, so that each
waiting prompt gets about the share of a step that one decode gets. Held back further, prompts that
outnumber the decodes would keep the batch small (a decode step costs about as much for a few sequences
as for many) for the sake of those few decodes.

Only prompts with more than `LONG_PREFILL_TOKENS` tokens (--long-prefill-token-threshold, vLLM's
flag) are paced: a chat turn's prompt is admitted whole (pacing it would add steps to every request's
time to first token), and the long stalls come from the long ones. On a slow CPU even a short prompt
beside running decodes costs a long step (docs/performance.md#chunked-prefill); threshold 0 paces every
prompt, for an operator who prefers steady inter-token latency to early first tokens. Without running
decodes nothing is paced.
"""

from __future__ import annotations

import statistics
from collections import deque

from data_plane.config import LONG_PREFILL_TOKENS  # the default of --long-prefill-token-threshold

__all__ = ["LONG_PREFILL_TOKENS", "PrefillPacer"]

MIN_LONG_CHUNK = 4  # a long prompt always progresses by at least this many tokens a step
WINDOW = 32  # recent steps the prefill-token cost is the median of
DECODE_WINDOW = 5  # recent decode-only steps t_decode is the median of (their cost drifts with context)
PROBE_EVERY = 6  # steps with prefill beside decodes between two steps of the decodes alone


class PrefillPacer:
    def __init__(self, stall_limit: float) -> None:
        if stall_limit <= 1.0:
            raise ValueError("stall_limit must be above 1 (a step with prefill costs more than one without)")
        self.stall_limit = stall_limit
        self._decode_step_s: deque[float] = deque(maxlen=DECODE_WINDOW)
        self._prefill_token_s: deque[float] = deque(maxlen=WINDOW)
        self._budget: int | None = None  # cached until the next observation
        self._last_budget = MIN_LONG_CHUNK
        self._mixed_steps = 0  # steps with prefill beside decodes since the last of decodes alone

    def observe(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        """One finished step: how many decode and prefill tokens it computed, and its wall time."""
        if num_decodes == 0:
            return  # nothing was stalled; the step says nothing about the cost beside decodes
        if num_prefill_tokens == 0:
            self._decode_step_s.append(seconds)
            self._mixed_steps = 0
        else:
            self._mixed_steps += 1
            if self._decode_step_s:
                extra = seconds - statistics.median(self._decode_step_s)
                self._prefill_token_s.append(max(extra, 0.0) / num_prefill_tokens)
        self._budget = None

    def long_prefill_budget(self, num_decodes: int, num_long_prompts: int = 1) -> int:
        """Tokens of long prompts the next step may compute beside `num_decodes` running decodes (> 0) while
        `num_long_prompts` long prompts wait or prefill; 0 on a probe step. (A probe that short prompts
        fill is no probe; the next comes PROBE_EVERY later, so that arrivals of short prompts never hold a
        long one back for good.)"""
        if self._mixed_steps and self._mixed_steps % PROBE_EVERY == 0:
            return 0
        if self._budget is None:
            self._budget = min(self._compute(num_decodes, num_long_prompts), 2 * self._last_budget)
            self._last_budget = self._budget
        return self._budget

    def _compute(self, num_decodes: int, num_long_prompts: int) -> int:
        if not self._decode_step_s:
            return MIN_LONG_CHUNK
        decode_s = statistics.median(self._decode_step_s)
        per_token = statistics.median(self._prefill_token_s) if self._prefill_token_s else decode_s / max(num_decodes, 1)
        if per_token <= 0.0:
            per_token = decode_s / max(num_decodes, 1) / 8  # prefill measured free: grow, but not unboundedly
        limit = max(self.stall_limit, 1.0 + num_long_prompts / max(num_decodes, 1))
        return max(MIN_LONG_CHUNK, int((limit - 1.0) * decode_s / per_token))
