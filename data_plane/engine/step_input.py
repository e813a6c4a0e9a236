"""Per-step data passed explicitly from the BatchBuilder to the ModelRunner and down to the layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes and which cached K/V each query attends to.

    Tokens are laid out decode first, then prefill: [d_0, d_1, …, p_0 tokens…, p_1 tokens…].
    Gather indices are built once per step (not per layer): key position j of sequence b lives
    at flat KV slot `*_gather_slots[b, j]`; padded positions point at slot 0 and are masked out.
    """

    slot_mapping: torch.Tensor  # [T] int64: flat KV slot written by each new token
    num_decode_tokens: int  # = number of decode sequences (one query each)
    decode_gather_slots: torch.Tensor | None  # [Bd, Ld] int64
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, Ld] bool: True = attend
    num_prefill_seqs: int
    prefill_query_lens: list[int]  # new tokens per prefill sequence
    prefill_gather_slots: torch.Tensor | None  # [Bp, Lp] int64 (cached prefix + new tokens)
    prefill_mask: torch.Tensor | None  # [Bp, 1, Qp, Lp] bool: causal with cached-prefix offset
    prefill_query_index: torch.Tensor | None  # [Bp, Qp] int64: flat prefill-token index (0-based), pads -> 0
    prefill_query_valid: torch.Tensor | None  # [Bp, Qp] bool

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.prefill_query_lens)


@dataclass
class StepInput:
    """One forward pass: flat tokens of every scheduled sequence and their metadata."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: flat index of the token whose logits are sampled, per sequence
    seq_ids: list[int]  # [S] in the order of logits_indices
    adapter_ids: list[int]  # [S] per sequence; 0 = base model
    lora: Any = None  # the LoRA batch (per-token slot indices, segments); None when no adapter is active
