"""Batched LoRA ops over stacked slot weights.

A fused layer's lanes (q/k/v, gate/up, or a single projection) share one shrink and one gather of B.
Weights are stored input-major so that every product is a row vector times a matrix, which the CPU
kernels run far faster as a batch than matrix-times-column-vector. For every token t routed to slot s
(tokens of the base model are left untouched), and each lane l with output columns cols_l:

    shrink:  v[t] = x[t] @ A[s]                               A: [slots, in, L * R]   ->  v: [N, L * R]
    expand:  y[t, cols_l] += v[t, l*R:(l+1)*R] @ B[s][:, cols_l]     B: [slots, R, out]  (scale folded in)

Only the first `batch.rank` of the R (= max_lora_rank) rank rows are used: slots are zero-padded past
each adapter's rank, so this is exact. Three shapes of work, chosen by the LoRABatch: one adapter for
the whole step (plain matmuls), decode tokens of mixed adapters (gather each token's slot weights +
batched vector-matrix products), runs of prefill tokens of one adapter (plain matmuls per run).
"""

from __future__ import annotations

import torch

from data_plane.lora.batch import LoRABatch

Lanes = list[tuple[int, int]]  # (first output column, width) of each lane


def _ranked(lora_a: torch.Tensor, lanes: int, rank: int) -> torch.Tensor:
    """[slots, in, L * R] -> a view [slots, in, L, rank]: the padding past the batch's rank dropped."""
    slots, dim, lr = lora_a.shape
    return lora_a.view(slots, dim, lanes, lr // lanes)[..., :rank]


def lora_shrink_expand(
    y: torch.Tensor,  # [T, out], updated in place
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [slots, in, L * R]
    lora_b: torch.Tensor,  # [slots, R, out]
    lanes: Lanes,
    batch: LoRABatch,
) -> None:
    num_lanes, rank, dim = len(lanes), batch.rank, x.shape[1]
    a_ranked = _ranked(lora_a, num_lanes, rank)
    if batch.single_slot is not None:
        s = batch.single_slot
        _expand_one(y, x @ a_ranked[s].reshape(dim, -1), lora_b[s, :rank], lanes, rank)
        return
    if batch.decode_index is not None:
        idx, slots = batch.decode_index, batch.decode_slots
        a = a_ranked.index_select(0, slots).view(len(slots), dim, num_lanes * rank)  # [Nd, in, L * rank]
        v = torch.bmm(x.index_select(0, idx).unsqueeze(1), a)  # [Nd, 1, L * rank]
        b = lora_b[:, :rank].index_select(0, slots)  # [Nd, rank, out]
        if batch.decode_contiguous:  # the usual case: accumulate straight into the decode rows of y
            y_rows = y[: len(slots)].unsqueeze(1)  # [Nd, 1, out], a view
            for lane, (offset, width) in enumerate(lanes):
                cols = slice(offset, offset + width)
                y_rows[:, :, cols].baddbmm_(v[:, :, lane * rank : (lane + 1) * rank], b[:, :, cols])
        else:
            delta = y.new_empty(len(slots), y.shape[1])
            for lane, (offset, width) in enumerate(lanes):
                cols = slice(offset, offset + width)
                delta[:, cols] = torch.bmm(v[:, :, lane * rank : (lane + 1) * rank], b[:, :, cols]).squeeze(1)
            y.index_add_(0, idx, delta)
    for s, start, end in batch.prefill_segments:
        _expand_one(y[start:end], x[start:end] @ a_ranked[s].reshape(dim, -1), lora_b[s, :rank], lanes, rank)


def _expand_one(y: torch.Tensor, v: torch.Tensor, b: torch.Tensor, lanes: Lanes, rank: int) -> None:
    """y[:, cols_l] += v[:, lane l's rank block] @ b[:, cols_l] for one adapter; b: [rank, out]."""
    for lane, (offset, width) in enumerate(lanes):
        cols = slice(offset, offset + width)
        y[:, cols].addmm_(v[:, lane * rank : (lane + 1) * rank], b[:, cols])
