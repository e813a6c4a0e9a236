"""LoRABatch: which device slot each token of a step uses, grouped for the batched ops."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRABatch:
    """Per-step LoRA routing, built once by the BatchBuilder and passed to every LoRA layer.

    Tokens of the base model (adapter 0) appear nowhere here, so they get exactly the base output.
    """

    rank: int  # the largest rank among the step's adapters: the ops skip the zero padding past it
    single_slot: int | None  # every token of the step uses this slot: one plain matmul per layer
    decode_index: torch.Tensor | None  # [Nd] int64: decode tokens (flat indices) that use an adapter
    decode_slots: torch.Tensor | None  # [Nd] int64: their slots (gather + bmm)
    decode_contiguous: bool  # decode_index is exactly 0..Nd-1: the deltas add to a slice
    prefill_groups: list[tuple[int, torch.Tensor]]  # (slot, [Np] flat token indices): one matmul per adapter

    @classmethod
    def build(
        cls,
        token_slots: list[int],  # [T] slot per flat token, -1 for the base model
        num_decode_tokens: int,
        rank: int,
        device: torch.device,
    ) -> LoRABatch | None:
        used = set(token_slots)
        if used == {-1}:
            return None
        if len(used) == 1:
            return cls(rank, token_slots[0], decode_index=None, decode_slots=None, decode_contiguous=False, prefill_groups=[])
        decode = [(i, s) for i, s in enumerate(token_slots[:num_decode_tokens]) if s >= 0]
        decode_index = decode_slots = None
        if decode:
            decode_index = torch.tensor([i for i, _ in decode], dtype=torch.int64, device=device)
            decode_slots = torch.tensor([s for _, s in decode], dtype=torch.int64, device=device)
        by_slot: dict[int, list[int]] = {}
        for i in range(num_decode_tokens, len(token_slots)):
            if token_slots[i] >= 0:
                by_slot.setdefault(token_slots[i], []).append(i)
        groups = [(slot, torch.tensor(ix, dtype=torch.int64, device=device)) for slot, ix in by_slot.items()]
        contiguous = len(decode) == num_decode_tokens
        return cls(rank, None, decode_index, decode_slots, contiguous, groups)
