"""Paged attention in plain PyTorch: write new K/V into the block cache, gather, SDPA.

The KV cache of one layer is a tensor [2, num_slots, num_kv_heads, head_dim] where
num_slots = num_blocks * block_size; slot = block_id * block_size + offset. Gather indices
and masks are built once per step by the BatchBuilder and shared by every layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from data_plane.engine.step_input import AttentionMetadata


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,  # [T, H * D]
        k: torch.Tensor,  # [T, Hkv * D]
        v: torch.Tensor,  # [T, Hkv * D]
        kv_cache: torch.Tensor,  # [2, num_slots, Hkv, D]
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H * D]
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        kv_cache[0].index_copy_(0, attn.slot_mapping, k.to(kv_cache.dtype))
        kv_cache[1].index_copy_(0, attn.slot_mapping, v.to(kv_cache.dtype))

        out = torch.empty_like(q)
        nd = attn.num_decode_tokens
        if nd:
            # one query per sequence: q [Bd, H, 1, D] against gathered keys [Bd, Hkv, Ld, D]
            out[:nd] = self._attend(q[:nd].unsqueeze(2), kv_cache, attn.decode_gather_slots, attn.decode_mask).squeeze(2)
        if attn.num_prefill_seqs:
            q_pad = q[nd:][attn.prefill_query_index].transpose(1, 2)  # [Bp, H, Qp, D]
            o_pad = self._attend(q_pad, kv_cache, attn.prefill_gather_slots, attn.prefill_mask)
            out[nd:] = o_pad.transpose(1, 2)[attn.prefill_query_valid]  # [Tp, H, D], row-major = flat order
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _attend(
        self,
        q: torch.Tensor,  # [B, H, Q, D]
        kv_cache: torch.Tensor,
        gather_slots: torch.Tensor,  # [B, L]
        mask: torch.Tensor,  # [B, 1, Q, L]
    ) -> torch.Tensor:  # [B, H, Q, D]
        keys = kv_cache[0][gather_slots].transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
        values = kv_cache[1][gather_slots].transpose(1, 2).to(q.dtype)
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
        )
