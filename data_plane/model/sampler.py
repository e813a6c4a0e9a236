"""Sampler: turn the last-position logits of each sequence into one token (vLLM semantics).

Order of operations, all batched over rows with per-row parameters:
  1. penalties (repetition over prompt+output, frequency and presence over output)
  2. min_tokens: eos ids and stop_token_ids get -inf while the output is shorter than min_tokens
  3. greedy rows (temperature 0): argmax of the logits so far
  4. sampled rows: temperature, top-k, top-p, min-p, then softmax and an exponential race
     (argmax of probs / q, q ~ Exp(1)), which is a draw from the categorical distribution.
Logprobs are taken from log_softmax of the *raw* model logits (vLLM's default "raw_logprobs").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from data_plane.engine.sequence import Sequence

# Below this temperature a row is treated as greedy (as vLLM does): dividing by it would overflow.
_SAMPLING_EPS = 1e-5


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [S] sampled token per sequence
    # per sequence: {sampled_id: lp, top ids: lp, ...} with the sampled id first; {} for a row that
    # did not ask; None when no sequence in the batch asked for logprobs
    logprobs: list[dict[int, float]] | None


class Sampler:
    def __init__(self, eos_token_ids: set[int]) -> None:
        self.eos_token_ids = set(eos_token_ids)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """logits: [S, V] float32 for the last position of each sequence, in the order of seqs."""
        params = [seq.sampling_params for seq in seqs]
        needs_min_tokens = [len(s.output_token_ids) < s.sampling_params.min_tokens for s in seqs]
        has_penalties = any(
            p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
            for p in params
        )
        wants_logprobs = any(p.logprobs is not None for p in params)
        is_greedy = [p.temperature < _SAMPLING_EPS for p in params]

        # Fast path: plain greedy decoding needs nothing but the argmax.
        if all(is_greedy) and not has_penalties and not any(needs_min_tokens) and not wants_logprobs:
            return SamplerOutput(token_ids=logits.argmax(dim=-1).tolist(), logprobs=None)

        raw_logits = logits
        logits = logits.float()  # [S, V]
        if has_penalties:
            logits = _apply_penalties(logits, seqs)
        if any(needs_min_tokens):
            logits = self._mask_stop_tokens(logits, seqs, needs_min_tokens)

        token_ids = logits.argmax(dim=-1)  # [S] greedy choice; replaced below for sampled rows
        if not all(is_greedy):
            sampled = self._sample(logits, seqs, is_greedy)
            greedy_mask = torch.tensor(is_greedy, device=logits.device)
            token_ids = torch.where(greedy_mask, token_ids, sampled)

        token_list: list[int] = token_ids.tolist()
        logprobs = _gather_logprobs(raw_logits, seqs, token_ids) if wants_logprobs else None
        return SamplerOutput(token_ids=token_list, logprobs=logprobs)

    def _mask_stop_tokens(
        self, logits: torch.Tensor, seqs: list[Sequence], needs_min_tokens: list[bool]
    ) -> torch.Tensor:
        """Set eos and stop_token_ids to -inf on rows that have not yet produced min_tokens."""
        vocab_size = logits.shape[1]
        rows: list[int] = []
        cols: list[int] = []
        for i, (seq, needed) in enumerate(zip(seqs, needs_min_tokens, strict=True)):
            if not needed:
                continue
            stop_ids = self.eos_token_ids | set(seq.sampling_params.stop_token_ids)
            ids = [t for t in stop_ids if 0 <= t < vocab_size]
            rows.extend([i] * len(ids))
            cols.extend(ids)
        if not rows:
            return logits
        logits = logits.clone()
        index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        logits[index] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], is_greedy: list[bool]) -> torch.Tensor:
        """Draw one token per row from the filtered softmax; returns [S] (greedy rows: don't care)."""
        vocab_size = logits.shape[1]
        device = logits.device
        params = [seq.sampling_params for seq in seqs]
        # Greedy rows get neutral parameters so they cannot produce inf/NaN; their draw is discarded.
        rows = list(zip(params, is_greedy, strict=True))
        temperature = torch.tensor([1.0 if g else p.temperature for p, g in rows], device=device)
        top_k = [vocab_size if g or p.top_k <= 0 else min(p.top_k, vocab_size) for p, g in rows]
        top_p = [1.0 if g else p.top_p for p, g in rows]
        min_p = [0.0 if g else p.min_p for p, g in rows]

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
        if any(seq.generator is None for seq in seqs):
            q.exponential_()
        for i, seq in enumerate(seqs):
            if seq.generator is not None and not is_greedy[i]:
                q[i].exponential_(generator=seq.generator)
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


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p × the row's top probability. logits: [S, V]; min_p: [S]."""
    probs = logits.softmax(dim=-1)  # [S, V]
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [S, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition (prompt + output), frequency and presence (output only) penalties. logits: [S, V]."""
    vocab_size = logits.shape[1]
    device = logits.device
    params = [seq.sampling_params for seq in seqs]
    rep = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)  # [S, 1]
    freq = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)

    output_counts = _bin_counts([s.output_token_ids for s in seqs], vocab_size, device)  # [S, V]
    output_mask = output_counts > 0
    if bool((rep != 1.0).any()):
        prompt_mask = _bin_counts([s.prompt_token_ids for s in seqs], vocab_size, device) > 0
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
    raw_logits: torch.Tensor, seqs: list[Sequence], token_ids: torch.Tensor
) -> list[dict[int, float]]:
    """Raw-logit logprobs of the sampled token and of each row's top-n tokens (sampled first)."""
    rows = [i for i, s in enumerate(seqs) if s.sampling_params.logprobs is not None]
    row_index = torch.tensor(rows, device=raw_logits.device)
    logprobs = torch.log_softmax(raw_logits[row_index].float(), dim=-1)  # [R, V]
    sampled_lp = logprobs.gather(1, token_ids[row_index].unsqueeze(1)).squeeze(1).tolist()  # [R]
    max_n = min(max(seqs[i].sampling_params.logprobs or 0 for i in rows), logprobs.shape[1])
    top_lp, top_ids = logprobs.topk(max_n, dim=-1)  # [R, max_n]
    top_lp_list, top_ids_list = top_lp.tolist(), top_ids.tolist()
    sampled_list = token_ids.tolist()

    out: list[dict[int, float]] = [{} for _ in seqs]
    for r, i in enumerate(rows):
        n = seqs[i].sampling_params.logprobs or 0
        entry = {sampled_list[i]: sampled_lp[r]}
        for tok, lp in zip(top_ids_list[r][:n], top_lp_list[r][:n], strict=True):
            entry.setdefault(tok, lp)
        out[i] = entry
    return out
