"""Batched LoRA ops over stacked slot weights: shrink, expand, and both in a row.

A fused layer's lanes (q/k/v, gate/up, or a single projection) share one shrink and one gather of B.
Weights are stored input-major so that every product is a row vector times a matrix, which the CPU
kernels run far faster as a batch than matrix-times-column-vector. For every token t routed to slot s
(tokens of the base model are left untouched), and each lane l with output columns cols_l:

    shrink:  v[t] = x[t] @ A[s]                               A: [slots, in, L * R]   ->  v: [T, L * rank]
    expand:  y[t, cols_l] += v[t, l*rank:(l+1)*rank] @ B[s][:, cols_l]   B: [slots, R, out] (scale folded in)

Only the first `batch.rank` of the R (= max_lora_rank) rank rows are used: slots are zero-padded past
each adapter's rank, so this is exact. Rows of v for base tokens are never read. Three shapes of work,
chosen by the LoRABatch: one adapter for the whole step (plain matmuls), decode tokens of mixed
adapters (gather each token's slot weights + batched vector-matrix products), runs of prefill tokens
of one adapter (plain matmuls per run). Row-parallel layers all-reduce v between the two halves.
"""

from __future__ import annotations

import torch

from data_plane.model.lora_batch import LoRABatch

Lanes = list[tuple[int, int]]  # (first output column, width) of each lane


def _ranked(lora_a: torch.Tensor, lanes: int, rank: int) -> torch.Tensor:
    """[slots, in, L * R] -> a view [slots, in, L, rank]: the padding past the batch's rank dropped."""
    slots, dim, lr = lora_a.shape
    return lora_a.view(slots, dim, lanes, lr // lanes)[..., :rank]


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, num_lanes: int, batch: LoRABatch) -> torch.Tensor:
    """x: [T, in], A: [slots, in, L * R] -> v: [T, L * rank]."""
    rank, dim = batch.rank, x.shape[1]
    a_ranked = _ranked(lora_a, num_lanes, rank)
    if batch.single_slot is not None:
        return x @ a_ranked[batch.single_slot].reshape(dim, -1)
    v = x.new_zeros(x.shape[0], num_lanes * rank)
    if batch.decode_index is not None:
        idx, slots = batch.decode_index, batch.decode_slots
        a = a_ranked.index_select(0, slots).view(len(slots), dim, num_lanes * rank)  # [Nd, in, L * rank]
        v_decode = torch.bmm(x.index_select(0, idx).unsqueeze(1), a).squeeze(1)  # [Nd, L * rank]
        if batch.decode_contiguous:
            v[: len(slots)] = v_decode
        else:
            v.index_copy_(0, idx, v_decode)
    for s, start, end in batch.prefill_segments:
        torch.mm(x[start:end], a_ranked[s].reshape(dim, -1), out=v[start:end])
    return v


def lora_expand(y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, lanes: Lanes, batch: LoRABatch) -> None:
    """y: [T, out] += per lane v's rank block @ B[s] (B: [slots, R, out]), in place."""
    rank = batch.rank
    if batch.single_slot is not None:
        _expand_one(y, v, lora_b[batch.single_slot, :rank], lanes, rank)
        return
    if batch.decode_index is not None:
        idx, slots = batch.decode_index, batch.decode_slots
        b = lora_b[:, :rank].index_select(0, slots)  # [Nd, rank, out]
        v_rows = (v[: len(slots)] if batch.decode_contiguous else v.index_select(0, idx)).unsqueeze(1)  # [Nd, 1, L*rank]
        # each bmm into a fresh tensor, then one add: bmm or baddbmm_ writing into a strided view of y
        # falls back to one small matmul per token on CPU
        if len(lanes) == 1:
            delta = torch.bmm(v_rows, b).squeeze(1)  # [Nd, out]
        else:
            delta = y.new_empty(len(slots), y.shape[1])
            for lane, (offset, width) in enumerate(lanes):
                cols = slice(offset, offset + width)
                delta[:, cols] = torch.bmm(v_rows[:, :, lane * rank : (lane + 1) * rank], b[:, :, cols]).squeeze(1)
        if batch.decode_contiguous:  # the usual case: every decode token uses an adapter
            y[: len(slots)] += delta
        else:
            y.index_add_(0, idx, delta)
    for s, start, end in batch.prefill_segments:
        _expand_one(y[start:end], v[start:end], lora_b[s, :rank], lanes, rank)


def lora_shrink_expand(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, lanes: Lanes, batch: LoRABatch
) -> None:
    """y += B·(A·x) per token's slot, in place: shrink then expand."""
    lora_expand(y, lora_shrink(x, lora_a, len(lanes), batch), lora_b, lanes, batch)


def _expand_one(y: torch.Tensor, v: torch.Tensor, b: torch.Tensor, lanes: Lanes, rank: int) -> None:
    """y[:, cols_l] += v[:, lane l's rank block] @ b[:, cols_l] for one adapter; b: [rank, out]."""
    for lane, (offset, width) in enumerate(lanes):
        cols = slice(offset, offset + width)
        y[:, cols].addmm_(v[:, lane * rank : (lane + 1) * rank], b[:, cols])
