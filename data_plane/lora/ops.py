"""Batched LoRA ops over stacked slot weights: shrink, expand, and both in a row.

A fused layer's lanes (q/k/v, gate/up, or a single projection) share one shrink and one gather of B.
Weights are stored input-major so that every product is a row vector times a matrix, which the CPU
kernels run far faster as a batch than matrix-times-column-vector. For every token t routed to slot s
(tokens of the base model are left untouched), and each lane l with output columns cols_l:

    shrink:  v[t] = x[t] @ A[s]                               A: [slots, in, L * R]   ->  v: [T, L * rank]
    expand:  y[t, cols_l] += v[t, l*rank:(l+1)*rank] @ B[s][:, cols_l]   B: [slots, R, out] (scale folded in)

Slots may be stored narrower than the activations (--lora-dtype bfloat16|float16 with a float32 model):
the products then read the rounded weights in the activations' dtype (the compiled kernels convert them
in registers; the torch ops make a copy), so the math is the same with A and B rounded.

Only the first `batch.rank` of the R (= max_lora_rank) rank rows are used: slots are zero-padded past
each adapter's rank, so this is exact. Rows of v for base tokens are never read. Three shapes of work,
chosen by the LoRABatch: one adapter for the whole step (plain matmuls), decode tokens of mixed
adapters (BGMV: each token with its own slot's weights), runs of prefill tokens of one adapter (SGMV:
one matmul per run). Row-parallel layers all-reduce v between the two halves.

The last two run on a `LoRAKernels` backend (kernels/select.py picks one per device), whose interface is
the batch's shrink, expand, and both in a row: `TorchKernels` here, plain torch everywhere (it gathers
each decode token's slot weights, then batched vector-matrix products), Triton on CUDA (both composed
from BGMV and SGMV primitives by `SplitKernels`), or the compiled CPU kernels, which read the slots in
place and run a layer's shrink and expand as one pass over every routed token.
"""

from __future__ import annotations

from typing import Protocol

import torch

from data_plane.model.lora_batch import LoRABatch

Lanes = list[tuple[int, int]]  # (first output column, width) of each lane


class LoRAKernels(Protocol):
    """The mixed-adapter half of the ops, over every routed token of the batch (decode tokens and prefill
    segments); every backend computes exactly the module docstring's math. Rows of base tokens are left alone."""

    def shrink(self, v: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, batch: LoRABatch, num_lanes: int) -> None:
        """For each routed token t of slot s: v[t] = x[t] @ A[s] (ranked lanes); v: [T, L * rank]."""

    def expand(self, y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, batch: LoRABatch, lanes: Lanes) -> None:
        """For each routed token t of slot s and lane l: y[t, cols_l] += v[t, lane l's block] @ B[s, :rank, cols_l]."""

    def shrink_expand(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      batch: LoRABatch, lanes: Lanes) -> None:
        """Both in a row, y[t] += (x[t] @ A[s]) @ B[s] per lane; a backend may skip the v tensor between them."""


class SplitKernels:
    """LoRAKernels out of four primitives: BGMV for the decode tokens, SGMV for the prefill segments."""

    def bgmv_shrink(self, v: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, index: torch.Tensor,
                    slots: torch.Tensor, num_lanes: int, rank: int, rows_from_zero: bool = False) -> None:
        """For each i: v[index[i]] = x[index[i]] @ A[slots[i]] (ranked lanes); v: [T, L * rank].
        rows_from_zero: index is 0..len(index)-1 (a hint a backend may use to slice instead of scatter)."""
        raise NotImplementedError

    def bgmv_expand(self, y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, index: torch.Tensor,
                    slots: torch.Tensor, lanes: Lanes, rank: int, rows_from_zero: bool = False) -> None:
        """For each i and lane l: y[index[i], cols_l] += v[index[i], lane l's block] @ B[slots[i], :rank, cols_l]."""
        raise NotImplementedError

    def sgmv_shrink(self, v: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, batch: LoRABatch,
                    num_lanes: int) -> None:
        """For each prefill segment (s, start, end): v[start:end] = x[start:end] @ A[s] (ranked lanes)."""
        raise NotImplementedError

    def sgmv_expand(self, y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, batch: LoRABatch,
                    lanes: Lanes) -> None:
        """For each prefill segment (s, start, end): y[start:end, cols_l] += v[start:end, lane l] @ B[s][:, cols_l]."""
        raise NotImplementedError

    def shrink(self, v: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, batch: LoRABatch, num_lanes: int) -> None:
        if batch.decode_index is not None and batch.decode_slots is not None:  # set together
            self.bgmv_shrink(v, x, lora_a, batch.decode_index, batch.decode_slots, num_lanes, batch.rank,
                             batch.decode_contiguous)
        if batch.prefill_segments:
            self.sgmv_shrink(v, x, lora_a, batch, num_lanes)

    def expand(self, y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, batch: LoRABatch, lanes: Lanes) -> None:
        if batch.decode_index is not None and batch.decode_slots is not None:  # set together
            self.bgmv_expand(y, v, lora_b, batch.decode_index, batch.decode_slots, lanes, batch.rank,
                             batch.decode_contiguous)
        if batch.prefill_segments:
            self.sgmv_expand(y, v, lora_b, batch, lanes)

    def shrink_expand(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      batch: LoRABatch, lanes: Lanes) -> None:
        v = x.new_zeros(x.shape[0], len(lanes) * batch.rank)  # [T, L * rank]
        self.shrink(v, x, lora_a, batch, len(lanes))
        self.expand(y, v, lora_b, batch, lanes)


def _as(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Slot weights in the activations' dtype: themselves, or a copy where slots are stored narrower."""
    return w if w.dtype == dtype else w.to(dtype)


def _ranked(lora_a: torch.Tensor, lanes: int, rank: int) -> torch.Tensor:
    """[slots, in, L * R] -> a view [slots, in, L, rank]: the padding past the batch's rank dropped."""
    slots, dim, lr = lora_a.shape
    return lora_a.view(slots, dim, lanes, lr // lanes)[..., :rank]


class TorchKernels(SplitKernels):
    """Plain torch: decode tokens gather their slots' weights (a copy per token), segments run one mm each."""

    def bgmv_shrink(self, v: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, index: torch.Tensor,
                    slots: torch.Tensor, num_lanes: int, rank: int, rows_from_zero: bool = False) -> None:
        n, dim = len(slots), x.shape[1]
        a = _as(_ranked(lora_a, num_lanes, rank).index_select(0, slots), x.dtype).view(n, dim, num_lanes * rank)  # [Nd, in, L*rank]
        x_rows = x[:n] if rows_from_zero else x.index_select(0, index)  # [Nd, in]
        v_decode = torch.bmm(x_rows.unsqueeze(1), a).squeeze(1)  # [Nd, L * rank]
        if rows_from_zero:
            v[:n] = v_decode
        else:
            v.index_copy_(0, index, v_decode)

    def bgmv_expand(self, y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, index: torch.Tensor,
                    slots: torch.Tensor, lanes: Lanes, rank: int, rows_from_zero: bool = False) -> None:
        n = len(slots)
        b = _as(lora_b[:, :rank].index_select(0, slots), y.dtype)  # [Nd, rank, out]
        v_rows = (v[:n] if rows_from_zero else v.index_select(0, index)).unsqueeze(1)  # [Nd, 1, L * rank]
        # each bmm into a fresh tensor, then one add: bmm or baddbmm_ writing into a strided view of y
        # falls back to one small matmul per token on CPU
        if len(lanes) == 1:
            delta = torch.bmm(v_rows, b).squeeze(1)  # [Nd, out]
        else:
            delta = y.new_empty(n, y.shape[1])
            for lane, (offset, width) in enumerate(lanes):
                cols = slice(offset, offset + width)
                delta[:, cols] = torch.bmm(v_rows[:, :, lane * rank : (lane + 1) * rank], b[:, :, cols]).squeeze(1)
        if rows_from_zero:  # the usual case: every decode token uses an adapter
            y[:n] += delta
        else:
            y.index_add_(0, index, delta)

    def sgmv_shrink(self, v: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, batch: LoRABatch,
                    num_lanes: int) -> None:
        a_ranked, dim = _ranked(lora_a, num_lanes, batch.rank), x.shape[1]
        for s, start, end in batch.prefill_segments:
            torch.mm(x[start:end], _as(a_ranked[s].reshape(dim, -1), x.dtype), out=v[start:end])

    def sgmv_expand(self, y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, batch: LoRABatch,
                    lanes: Lanes) -> None:
        for s, start, end in batch.prefill_segments:
            _expand_one(y[start:end], v[start:end], lora_b[s, : batch.rank], lanes, batch.rank)


TORCH_KERNELS = TorchKernels()


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, num_lanes: int, batch: LoRABatch,
                kernels: LoRAKernels = TORCH_KERNELS) -> torch.Tensor:
    """x: [T, in], A: [slots, in, L * R] -> v: [T, L * rank]."""
    rank, dim = batch.rank, x.shape[1]
    if batch.single_slot is not None:
        return x @ _as(_ranked(lora_a, num_lanes, rank)[batch.single_slot].reshape(dim, -1), x.dtype)
    v = x.new_zeros(x.shape[0], num_lanes * rank)
    kernels.shrink(v, x, lora_a, batch, num_lanes)
    return v


def lora_expand(y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, lanes: Lanes, batch: LoRABatch,
                kernels: LoRAKernels = TORCH_KERNELS) -> None:
    """y: [T, out] += per lane v's rank block @ B[s] (B: [slots, R, out]), in place."""
    if batch.single_slot is not None:
        _expand_one(y, v, lora_b[batch.single_slot, : batch.rank], lanes, batch.rank)
    else:
        kernels.expand(y, v, lora_b, batch, lanes)


def lora_shrink_expand(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, lanes: Lanes, batch: LoRABatch,
    kernels: LoRAKernels = TORCH_KERNELS,
) -> None:
    """y += B·(A·x) per token's slot, in place: shrink then expand (in one pass where the kernels can)."""
    if batch.single_slot is not None:
        lora_expand(y, lora_shrink(x, lora_a, len(lanes), batch), lora_b, lanes, batch)
    else:
        kernels.shrink_expand(y, x, lora_a, lora_b, batch, lanes)


def _expand_one(y: torch.Tensor, v: torch.Tensor, b: torch.Tensor, lanes: Lanes, rank: int) -> None:
    """y[:, cols_l] += v[:, lane l's rank block] @ b[:, cols_l] for one adapter; b: [rank, out]."""
    b = _as(b, y.dtype)
    for lane, (offset, width) in enumerate(lanes):
        cols = slice(offset, offset + width)
        y[:, cols].addmm_(v[:, lane * rank : (lane + 1) * rank], b[:, cols])

