"""Sampler: turn the last-position logits of each sequence into one token (vLLM semantics).

Order of operations, all batched over rows with per-row parameters (vLLM's order):
  -1. allowed tokens: a constrained row's logits outside its grammar's bitmask become -inf (structured
      outputs, data_plane/structured); rows without a bitmask are left alone
  0. logit_bias: each biased row's {token id: bias} added to its logits, greedy rows included
  1. penalties (repetition over prompt+output, frequency and presence over output)
  2. min_tokens: eos ids and stop_token_ids get -inf while the output is shorter than min_tokens
  3. greedy rows (temperature 0): argmax of the logits so far
  4. sampled rows: temperature, top-k, top-p, min-p, then softmax and an exponential race
     (argmax of probs / q, q ~ Exp(1)), which is a draw from the categorical distribution.
Logprobs are taken from log_softmax of the *raw* model logits (vLLM's default "raw_logprobs"), so
they are reported before the grammar's mask, logit_bias, penalties and every other step here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Below this temperature a row is treated as greedy (as vLLM does): dividing by it would overflow.
_SAMPLING_EPS = 1e-5


@dataclass
class SamplingRow:
    """What the sampler needs of one sequence (one row of logits), as plain values; the engine builds
    it from the sequence's SamplingParams and tokens (data_plane/engine/batch_builder.py)."""

    temperature: float = 1.0
    top_k: int = -1  # -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None  # how many top logprobs to return; None: none at all
    logit_bias: dict[int, float] | None = None  # token id -> bias added to the logit; None: no bias
    below_min_tokens: bool = False  # min_tokens not reached yet: eos and stop_token_ids get -inf
    stop_token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None  # a seeded request's own; None: the global RNG
    # [ceil(V / 32)] int32, bit t % 32 of word t // 32 set: token t is allowed (a structured output's grammar);
    # None: every token
    allowed_tokens: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [S] sampled token per sequence
    # per sequence: {sampled_id: lp, top ids: lp, ...} with the sampled id first; {} for a row that
    # did not ask; None when no sequence in the batch asked for logprobs
    logprobs: list[dict[int, float]] | None


class Sampler:
    def __init__(self, eos_token_ids: set[int]) -> None:
        self.eos_token_ids = set(eos_token_ids)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits: [S, V] float32 for the last position of each sequence, one SamplingRow per row."""
        needs_min_tokens = [r.below_min_tokens for r in rows]
        has_bias = any(r.logit_bias for r in rows)
        has_penalties = any(
            p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
            for p in rows
        )
        wants_logprobs = any(p.logprobs is not None for p in rows)
        is_greedy = [p.temperature < _SAMPLING_EPS for p in rows]
        constrained = [i for i, r in enumerate(rows) if r.allowed_tokens is not None]

        # Fast path: plain greedy decoding needs nothing but the argmax.
        plain = not (has_bias or has_penalties or any(needs_min_tokens) or wants_logprobs or constrained)
        if all(is_greedy) and plain:
            return SamplerOutput(token_ids=logits.argmax(dim=-1).tolist(), logprobs=None)

        raw_logits = logits
        logits = logits.float()  # [S, V]
        if constrained:
            logits = apply_token_bitmask(logits, constrained, [rows[i].allowed_tokens for i in constrained])
        if has_bias:
            logits = _apply_logit_bias(logits, rows)
        if has_penalties:
            logits = _apply_penalties(logits, rows)
        if any(needs_min_tokens):
            logits = self._mask_stop_tokens(logits, rows)

        token_ids = logits.argmax(dim=-1)  # [S] greedy choice; replaced below for sampled rows
        if not all(is_greedy):
            sampled = self._sample(logits, rows, is_greedy)
            greedy_mask = torch.tensor(is_greedy, device=logits.device)
            token_ids = torch.where(greedy_mask, token_ids, sampled)

        token_list: list[int] = token_ids.tolist()
        logprobs = _gather_logprobs(raw_logits, rows, token_ids) if wants_logprobs else None
        return SamplerOutput(token_ids=token_list, logprobs=logprobs)

    def _mask_stop_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Set eos and stop_token_ids to -inf on rows that have not yet produced min_tokens."""
        vocab_size = logits.shape[1]
        row_index: list[int] = []
        cols: list[int] = []
        for i, row in enumerate(rows):
            if not row.below_min_tokens:
                continue
            stop_ids = self.eos_token_ids | set(row.stop_token_ids)
            ids = [t for t in stop_ids if 0 <= t < vocab_size]
            row_index.extend([i] * len(ids))
            cols.extend(ids)
        if not row_index:
            return logits
        logits = logits.clone()
        index = (torch.tensor(row_index, device=logits.device), torch.tensor(cols, device=logits.device))
        logits[index] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], is_greedy: list[bool]) -> torch.Tensor:
        """Draw one token per row from the filtered softmax; returns [S] (greedy rows: don't care)."""
        vocab_size = logits.shape[1]
        device = logits.device
        # Greedy rows get neutral parameters so they cannot produce inf/NaN; their draw is discarded.
        pairs = list(zip(rows, is_greedy, strict=True))
        temperature = torch.tensor([1.0 if g else p.temperature for p, g in pairs], device=device)
        top_k = [vocab_size if g or p.top_k <= 0 else min(p.top_k, vocab_size) for p, g in pairs]
        top_p = [1.0 if g else p.top_p for p, g in pairs]
        min_p = [0.0 if g else p.min_p for p, g in pairs]

        logits = logits / temperature.unsqueeze(1)  # [S, V]
        if any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
            logits = apply_top_k_top_p(
                logits,
                torch.tensor(top_k, dtype=torch.long, device=device),
                torch.tensor(top_p, dtype=logits.dtype, device=device),
            )
        if any(p > 0.0 for p in min_p):
            logits = apply_min_p(logits, torch.tensor(min_p, dtype=logits.dtype, device=device))
        probs = logits.softmax(dim=-1)  # [S, V]

        # Exponential race: argmax(probs / q) with q ~ Exp(1) i.i.d. is a categorical draw. Seeded rows
        # draw their own q row with their generator, so their tokens do not depend on the rest of the batch.
        q = torch.empty_like(probs)
        if any(row.generator is None for row in rows):
            q.exponential_()
        for i, row in enumerate(rows):
            if row.generator is not None and not is_greedy[i]:
                q[i].exponential_(generator=row.generator)
        q.clamp_(min=torch.finfo(q.dtype).tiny)  # q == 0 would turn a masked token's 0/0 into NaN
        return (probs / q).argmax(dim=-1)  # [S]


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf the tokens outside each row's top-k and top-p nucleus.

    logits: [S, V]; top_k: [S] long in [1, V] (V = off); top_p: [S] in (0, 1] (1 = off).
    Same rules as vLLM / transformers: ties with the k-th logit are kept; top-p drops the
    low-probability tail whose cumulative mass is <= 1 - p, and always keeps the best token.
    """
    vocab_size = logits.shape[1]
    logits_sort, order = logits.sort(dim=-1, descending=False)  # [S, V] ascending
    # the k-th largest sits at ascending position V - k
    kth = logits_sort.gather(1, (vocab_size - top_k).unsqueeze(1))  # [S, 1]
    logits_sort = logits_sort.masked_fill(logits_sort < kth, float("-inf"))
    cum_probs = logits_sort.softmax(dim=-1).cumsum(dim=-1)  # [S, V]
    tail = cum_probs <= (1.0 - top_p).unsqueeze(1)
    tail[:, -1] = False  # the most likely token always survives
    logits_sort = logits_sort.masked_fill(tail, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, logits_sort)  # back to vocab order


def apply_token_bitmask(logits: torch.Tensor, row_index: list[int], bitmasks: list[torch.Tensor | None]) -> torch.Tensor:
    """A new [S, V] tensor: rows `row_index` masked to -inf outside their bitmask ([W] int32 each, W*32 >= V
    or shorter: tokens past the mask are not allowed); the other rows as they are."""
    vocab_size = logits.shape[1]
    device = logits.device
    words = torch.stack([b for b in bitmasks if b is not None]).to(device)  # [R, W]
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [R, W * 32]
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))
    index = torch.tensor(row_index, device=device)
    masked = logits[index].masked_fill(~allowed[:, :vocab_size], float("-inf"))  # [R, V]
    return logits.index_copy(0, index, masked)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p × the row's top probability. logits: [S, V]; min_p: [S]."""
    probs = logits.softmax(dim=-1)  # [S, V]
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [S, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """A new [S, V] tensor: each row's logit_bias added to its logits, in one scatter of the flattened
    (row, token id, bias) triples on the logits' device; rows without a bias are left as they are."""
    biased = [(i, row.logit_bias) for i, row in enumerate(rows) if row.logit_bias]
    row_index = [i for i, bias in biased for _ in bias]
    cols = [t for _, bias in biased for t in bias]
    values = [v for _, bias in biased for v in bias.values()]
    device = logits.device
    index = (torch.tensor(row_index, device=device), torch.tensor(cols, device=device))
    return logits.index_put(index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt + output), frequency and presence (output only) penalties. logits: [S, V]."""
    vocab_size = logits.shape[1]
    device = logits.device
    rep = torch.tensor([p.repetition_penalty for p in rows], device=device).unsqueeze(1)  # [S, 1]
    freq = torch.tensor([p.frequency_penalty for p in rows], device=device).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in rows], device=device).unsqueeze(1)

    output_counts = _bin_counts([r.output_token_ids for r in rows], vocab_size, device)  # [S, V]
    output_mask = output_counts > 0
    if bool((rep != 1.0).any()):
        prompt_mask = _bin_counts([r.prompt_token_ids for r in rows], vocab_size, device) > 0
        seen = prompt_mask | output_mask  # [S, V]
        # vLLM/CTRL rule: shrink positive logits, push negative ones further down
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    logits = logits - freq * output_counts.to(logits.dtype)
    return logits - pres * output_mask.to(logits.dtype)


def _bin_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Per-row token counts [S, V] via scatter_add over a padded [S, L] tensor (pad id = V, dropped)."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.tensor(
        [t + [vocab_size] * (width - len(t)) for t in token_lists], dtype=torch.long, device=device
    ).view(len(token_lists), width)  # [S, L]
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.long, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab_size]


def _gather_logprobs(
    raw_logits: torch.Tensor, rows: list[SamplingRow], token_ids: torch.Tensor
) -> list[dict[int, float]]:
    """Raw-logit logprobs of the sampled token and of each row's top-n tokens (sampled first)."""
    asking = [i for i, r in enumerate(rows) if r.logprobs is not None]
    row_index = torch.tensor(asking, device=raw_logits.device)
    logprobs = torch.log_softmax(raw_logits[row_index].float(), dim=-1)  # [R, V]
    sampled_lp = logprobs.gather(1, token_ids[row_index].unsqueeze(1)).squeeze(1).tolist()  # [R]
    max_n = min(max(rows[i].logprobs or 0 for i in asking), logprobs.shape[1])
    top_lp, top_ids = logprobs.topk(max_n, dim=-1)  # [R, max_n]
    top_lp_list, top_ids_list = top_lp.tolist(), top_ids.tolist()
    sampled_list = token_ids.tolist()

    out: list[dict[int, float]] = [{} for _ in rows]
    for r, i in enumerate(asking):
        n = rows[i].logprobs or 0
        entry = {sampled_list[i]: sampled_lp[r]}
        for tok, lp in zip(top_ids_list[r][:n], top_lp_list[r][:n], strict=True):
            entry.setdefault(tok, lp)
        out[i] = entry
    return out
