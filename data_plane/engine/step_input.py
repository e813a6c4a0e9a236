"""Per-step data passed explicitly from the BatchBuilder to the ModelRunner and down to the layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from data_plane.lora.batch import LoRABatch


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes and which cached K/V each query attends to.

    Tokens are laid out decode first, then prefill: [d_0, d_1, …, p_0 tokens…, p_1 tokens…].
    Built once per step, shared by every layer. Each layer gathers whole blocks by block table
    (padded with block 0) and keeps the first `*_context_len` key positions; positions past a
    sequence's own length are masked out.
    """

    block_size: int
    slot_mapping: torch.Tensor  # [T] int64: flat KV slot written by each new token
    num_decode_tokens: int  # = number of decode sequences (one query each)
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks] int64
    decode_context_len: int  # Ld: the longest decode context
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, Ld] bool: True = attend; None when every key is visible
    num_prefill_seqs: int
    prefill_block_tables: torch.Tensor | None  # [Bp, max_blocks] int64
    prefill_context_len: int  # Lp: the longest cached prefix + new tokens
    prefill_mask: torch.Tensor | None  # [Bp, 1, Qp, Lp] bool: causal with cached-prefix offset; None = plain causal
    prefill_query_index: torch.Tensor | None  # [Bp, Qp] int64: flat prefill-token index (0-based), pads -> 0
    prefill_query_valid: torch.Tensor | None  # [Bp, Qp] bool


@dataclass
class StepInput:
    """One forward pass: flat tokens of every scheduled sequence and their metadata."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: flat index of the token whose logits are sampled, per sequence
    adapter_ids: list[int]  # [S] per sequence; 0 = base model
    lora: LoRABatch | None = None  # which slot each token uses; None when no token uses an adapter
