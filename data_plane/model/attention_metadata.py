"""AttentionMetadata: what every attention layer needs of one step, and how it is built from block tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    num_decode_tokens: int  # decode rows, one query each: the decodes, then any folded short chunks' tokens
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks] int64
    decode_context_len: int  # Ld: the longest decode context
    decode_context_lens: torch.Tensor | None  # [Bd] int64: each decode's own context (for the CPU kernel)
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, Ld] bool: True = attend; None when every key is visible
    num_prefill_seqs: int
    prefill_block_tables: torch.Tensor | None  # [Bp, max_blocks] int64
    prefill_context_len: int  # Lp: the longest cached prefix + new tokens
    prefill_mask: torch.Tensor | None  # [Bp, 1, Qp, Lp] bool: causal with cached-prefix offset; None = plain causal
    prefill_query_index: torch.Tensor | None  # [Bp, Qp] int64: flat prefill-token index (0-based), pads -> 0
    prefill_query_valid: torch.Tensor | None  # [Bp, Qp] bool
    # no prefill has cached tokens: its keys are exactly this step's, so attention need not gather them
    prefill_keys_in_step: bool = False


# A continuing prompt's chunk of at most this many tokens attends as that many decode tokens when the
# decode kernel reads the cache in place: query i of a chunk after num_computed cached tokens sees the
# first num_computed + i + 1 positions, exactly a decode row of that context length. Gathering the
# chunk's whole context per layer for SDPA costs more than its few queries up to about this many, where the
# two meet (the kernel's cost grows with queries × context). Why: docs/performance.md#chunked-prefill
FOLDED_CHUNK_TOKENS = 16


@dataclass
class DecodeEntry:
    block_table: list[int]
    context_len: int  # tokens in the cache after this step, including the new one


@dataclass
class PrefillEntry:
    block_table: list[int]
    num_computed: int  # tokens already in the cache (prefix-cache hit)
    num_new: int  # tokens computed this step


def _padded_block_tables(tables: list[list[int]]) -> torch.Tensor:  # [B, max_blocks]
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)


def _slots_of(block_table: list[int], start: int, stop: int, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, stop)]


def fold_short_chunks(decode: list[DecodeEntry], prefill: list[PrefillEntry]) -> tuple[list[DecodeEntry], list[PrefillEntry]]:
    """The leading prefills that continue a prompt in short chunks, as decode rows (FOLDED_CHUNK_TOKENS);
    only leading ones, since tokens are laid out decodes first and a row is a token."""
    folded = 0
    while folded < len(prefill) and prefill[folded].num_computed and prefill[folded].num_new <= FOLDED_CHUNK_TOKENS:
        folded += 1
    rows = [DecodeEntry(p.block_table, p.num_computed + i + 1) for p in prefill[:folded] for i in range(p.num_new)]
    return decode + rows, prefill[folded:]


def build_attention_metadata(
    decode: list[DecodeEntry], prefill: list[PrefillEntry], block_size: int, device: torch.device,
    fold_chunks: bool = False,
) -> AttentionMetadata:
    """`fold_chunks`: the layers read decode rows in place (the CPU kernel), so short chunks go there."""
    if fold_chunks:
        decode, prefill = fold_short_chunks(decode, prefill)
    slot_mapping: list[int] = []
    decode_tables = decode_mask = ctx = None
    decode_len = 0
    if decode:
        ctx = torch.tensor([d.context_len for d in decode])
        length = decode_len = int(ctx.max())
        decode_tables = _padded_block_tables([d.block_table for d in decode])
        if bool((ctx != length).any()):  # equal lengths need no mask, and SDPA runs faster without one
            decode_mask = (torch.arange(length)[None, :] < ctx[:, None])[:, None, None, :]  # [Bd, 1, 1, Ld]
        for d in decode:
            slot_mapping.extend(_slots_of(d.block_table, d.context_len - 1, d.context_len, block_size))

    prefill_tables = prefill_mask = query_index = query_valid = None
    prefill_len = 0
    if prefill:
        computed = torch.tensor([p.num_computed for p in prefill])
        new = torch.tensor([p.num_new for p in prefill])
        length = prefill_len = int((computed + new).max())
        max_q = int(new.max())
        prefill_tables = _padded_block_tables([p.block_table for p in prefill])
        qi = torch.arange(max_q)
        query_valid = qi[None, :] < new[:, None]  # [Bp, Qp]
        starts = torch.cumsum(new, 0) - new
        query_index = torch.where(query_valid, starts[:, None] + qi[None, :], 0)
        if bool(computed.any()) or bool((new != max_q).any()):
            # key j is visible to query i of sequence b when j <= num_computed[b] + i (causal, prefix offset)
            keys = torch.arange(length)
            mask = keys[None, None, :] <= (computed[:, None, None] + qi[None, :, None])  # [Bp, Qp, Lp]
            # padded query rows attend key 0 only, so SDPA never sees an all-masked row (NaN); they are dropped
            mask = torch.where(query_valid[:, :, None], mask, keys[None, None, :] == 0)
            prefill_mask = mask[:, None]
        # else: equal fresh prompts, plain causal attention (prefill_mask None)
        for p in prefill:
            slot_mapping.extend(_slots_of(p.block_table, p.num_computed, p.num_computed + p.num_new, block_size))

    def dev(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    return AttentionMetadata(
        block_size=block_size,
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        num_decode_tokens=len(decode),
        decode_block_tables=dev(decode_tables),
        decode_context_len=decode_len,
        decode_context_lens=dev(ctx),
        decode_mask=dev(decode_mask),
        num_prefill_seqs=len(prefill),
        prefill_block_tables=dev(prefill_tables),
        prefill_context_len=prefill_len,
        prefill_mask=dev(prefill_mask),
        prefill_query_index=dev(query_index),
        prefill_query_valid=dev(query_valid),
        prefill_keys_in_step=bool(prefill) and not any(p.num_computed for p in prefill),
    )
