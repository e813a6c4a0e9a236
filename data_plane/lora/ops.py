"""Batched LoRA ops over stacked slot weights.

Semantics, for every token t routed to slot s (tokens of the base model are left untouched):

    shrink:  v[t] = A[s] @ x[t]              A: [slots, R, in]    x: [T, in]   ->  v: [T, R]
    expand:  y[t] += B[s] @ v[t]             B: [slots, out, R]   (scale already folded into B)

`lora_add(y, x, A, B, batch)` does both. Three shapes of work, chosen by the LoRABatch:
one adapter for the whole step (two plain matmuls), decode tokens of mixed adapters (gather the
slots' weights per token + bmm), prefill tokens (one matmul pair per distinct adapter).
"""

from __future__ import annotations

import torch

from data_plane.lora.batch import LoRABatch


def lora_add(
    y: torch.Tensor,  # [T, out], updated in place
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [slots, R, in]
    lora_b: torch.Tensor,  # [slots, out, R]
    batch: LoRABatch,
) -> None:
    if batch.single_slot is not None:
        y += (x @ lora_a[batch.single_slot].T) @ lora_b[batch.single_slot].T
        return
    if batch.decode_index is not None:
        xs = x.index_select(0, batch.decode_index)  # [Nd, in]
        a = lora_a.index_select(0, batch.decode_slots)  # [Nd, R, in]
        b = lora_b.index_select(0, batch.decode_slots)  # [Nd, out, R]
        v = torch.bmm(a, xs.unsqueeze(-1))  # [Nd, R, 1]
        y.index_add_(0, batch.decode_index, torch.bmm(b, v).squeeze(-1))
    for slot, index in batch.prefill_groups:
        xs = x.index_select(0, index)  # [Np, in]
        y.index_add_(0, index, (xs @ lora_a[slot].T) @ lora_b[slot].T)
