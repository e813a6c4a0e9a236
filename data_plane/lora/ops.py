"""Batched LoRA ops over stacked slot weights.

A layer's lanes (q/k/v, gate/up, or a single projection) share one shrink and expand separately.
Semantics, for every token t routed to slot s (tokens of the base model are left untouched):

    shrink:  v[t] = A[s] @ x[t]                      A: [slots, L * R, in]   x: [T, in]  ->  v: [N, L * R]
    expand:  y_l[t] += B_l[s] @ v[t, l*R:(l+1)*R]    B_l: [slots, out_l, R]  (scale folded into B_l)

Only the first `batch.rank` of the R (= max_lora_rank) rank columns are used: slots are zero-padded
past each adapter's rank, so this is exact. Three shapes of work, chosen by the LoRABatch: one adapter
for the whole step (plain matmuls), decode tokens of mixed adapters (gather each token's slot weights
+ bmm), prefill tokens of mixed adapters (plain matmuls per distinct adapter).
"""

from __future__ import annotations

import torch

from data_plane.lora.batch import LoRABatch


def _ranked_a(lora_a: torch.Tensor, lanes: int, rank: int) -> torch.Tensor:
    """[slots, L * R, in] -> [slots, L * rank, in]: drop the all-zero padding past the batch's rank."""
    slots, lr, dim = lora_a.shape
    return lora_a.view(slots, lanes, lr // lanes, dim)[:, :, :rank].reshape(slots, lanes * rank, dim)


def lora_shrink_expand(
    outputs: list[torch.Tensor],  # L lane views of y, each [T, out_l], updated in place
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [slots, L * R, in]
    lora_bs: list[torch.Tensor],  # L tensors [slots, out_l, R]
    batch: LoRABatch,
) -> None:
    lanes, rank = len(lora_bs), batch.rank
    if batch.single_slot is not None:
        s = batch.single_slot
        a = _ranked_a(lora_a[s : s + 1], lanes, rank)[0]  # [L * rank, in]
        v = x @ a.T  # [T, L * rank]
        for lane, (y, b) in enumerate(zip(outputs, lora_bs, strict=True)):
            y += v[:, lane * rank : (lane + 1) * rank] @ b[s, :, :rank].T
        return
    if batch.decode_index is not None:
        idx, slots = batch.decode_index, batch.decode_slots
        a = _ranked_a(lora_a.index_select(0, slots), lanes, rank)  # [Nd, L * rank, in]
        v = torch.bmm(a, x.index_select(0, idx).unsqueeze(-1))  # [Nd, L * rank, 1]
        for lane, (y, b) in enumerate(zip(outputs, lora_bs, strict=True)):
            b_tok = b.index_select(0, slots)[:, :, :rank]  # [Nd, out_l, rank]
            y.index_add_(0, idx, torch.bmm(b_tok, v[:, lane * rank : (lane + 1) * rank]).squeeze(-1))
    for s, idx in batch.prefill_groups:
        a = _ranked_a(lora_a[s : s + 1], lanes, rank)[0]
        v = x.index_select(0, idx) @ a.T  # [Np, L * rank]
        for lane, (y, b) in enumerate(zip(outputs, lora_bs, strict=True)):
            y.index_add_(0, idx, v[:, lane * rank : (lane + 1) * rank] @ b[s, :, :rank].T)
