"""Paged attention: write new K/V into the block cache, then attend over each sequence's blocks.

The KV cache of one layer is a tensor [2, num_slots, num_kv_heads, head_dim] where
num_slots = num_blocks * block_size; slot = block_id * block_size + offset. Block tables and
masks are built once per step by the BatchBuilder and shared by every layer.

Decode tokens run through `decode_kernel` when one is set (the CPU kernel, which reads the blocks in
place; attention_kernels.py chooses it at load), else through the torch path: gather the blocks into
a padded copy, then SDPA. Prefill tokens always take SDPA.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from data_plane.model.attention_metadata import AttentionMetadata


class DecodeAttentionKernel(Protocol):
    """The compiled decode attention (attention_kernels.py loads it): one query per sequence over its
    own context, read in place through its block table."""

    def __call__(
        self,
        out: torch.Tensor,  # [B, H, D], written
        q: torch.Tensor,  # [B, H, D]
        kv_cache: torch.Tensor,  # [2, num_slots, Hkv, D]
        block_tables: torch.Tensor,  # [B, max_blocks] int64
        context_lens: torch.Tensor,  # [B] int64
        block_size: int,
        scale: float,
    ) -> None: ...


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.decode_kernel: DecodeAttentionKernel | None = None  # None: the torch path

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
        # the block tables are set exactly when there are decode rows / prefills (build_attention_metadata)
        if nd and self.decode_kernel is not None and attn.decode_context_lens is not None:
            assert attn.decode_block_tables is not None
            self.decode_kernel(out[:nd], q[:nd], kv_cache, attn.decode_block_tables, attn.decode_context_lens,
                               attn.block_size, self.scale)
        elif nd:
            # One query per sequence, so the query heads sharing a KV head can stand in the query-length
            # axis: q [Bd, Hkv, group, D] against keys [Bd, Hkv, Ld, D] — GQA without repeating K/V.
            grouped = q[:nd].view(nd, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
            assert attn.decode_block_tables is not None
            keys, values = self._gather(
                kv_cache, attn.decode_block_tables, attn.decode_context_len, attn.block_size, q.dtype
            )
            o = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=attn.decode_mask, scale=self.scale)
            out[:nd] = o.reshape(nd, self.num_heads, self.head_dim)
        if attn.num_prefill_seqs:
            q_pad = q[nd:][attn.prefill_query_index].transpose(1, 2)  # [Bp, H, Qp, D]
            if attn.prefill_keys_in_step:  # fresh prompts: Lp == Qp, pads are masked or past the causal edge
                keys = k[nd:][attn.prefill_query_index].transpose(1, 2)  # [Bp, Hkv, Qp, D]
                values = v[nd:][attn.prefill_query_index].transpose(1, 2)
            else:
                assert attn.prefill_block_tables is not None
                keys, values = self._gather(
                    kv_cache, attn.prefill_block_tables, attn.prefill_context_len, attn.block_size, q.dtype
                )
            o_pad = F.scaled_dot_product_attention(
                q_pad,
                keys,
                values,
                attn_mask=attn.prefill_mask,
                is_causal=attn.prefill_mask is None,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            out[nd:] = o_pad.transpose(1, 2)[attn.prefill_query_valid]  # [Tp, H, D], row-major = flat order
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _gather(
        self, kv_cache: torch.Tensor, block_tables: torch.Tensor, length: int, block_size: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:  # each [B, Hkv, L, D]
        batch, max_blocks = block_tables.shape
        # whole blocks in one index_select (far cheaper than per-slot indexing): [2, B * nb, bs, Hkv, D]
        blocks = kv_cache.view(2, -1, block_size, self.num_kv_heads, self.head_dim).index_select(1, block_tables.view(-1))
        kv = blocks.view(2, batch, max_blocks * block_size, self.num_kv_heads, self.head_dim)[:, :, :length]
        kv = kv.transpose(2, 3).to(dtype)  # [2, B, Hkv, L, D]
        return kv[0], kv[1]
