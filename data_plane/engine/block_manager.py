"""Paged KV blocks with prefix caching.

A full block's hash is xxh3_64 over (parent hash, token ids); the first block's parent is the
sequence's `prefix_hash_seed` (0 for the base model, the adapter's cache namespace otherwise),
so two adapters never share KV. A hit also compares the token ids. Blocks whose reference count
drops to zero keep their hash and stay reusable until they are evicted, least recently freed first.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass, field

import xxhash

from data_plane.engine.sequence import Sequence


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    return xxhash.xxh3_64_intdigest(struct.pack(f"<Q{len(token_ids)}q", parent_hash, *token_ids))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0


@dataclass
class _SeqHashes:
    hashes: list[int] = field(default_factory=list)  # hash of each full block, in order


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks in eviction order (front = evicted first); cached ones keep their hash until evicted
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.seq_hashes: dict[int, _SeqHashes] = {}
        self.stats = PrefixCacheStats()
        self.watermark = max(1, num_blocks // 100)  # headroom kept so admitted prompts can start decoding

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- admission (prefill) -------------------------------------------------------------------
    def _prefix_hits(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Hashes of the sequence's full blocks and the block ids of its cached prefix."""
        tokens = seq.all_token_ids
        hashes: list[int] = []
        hits: list[int] = []
        parent = seq.request.prefix_hash_seed
        # the last token is always computed (its logits are sampled), so it is never served from cache
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            chunk = tuple(tokens[start : start + self.block_size])
            parent = hash_block(parent, chunk)
            hashes.append(parent)
            if not self.enable_prefix_caching or len(hits) < len(hashes) - 1:
                continue
            block_id = self.cached.get(parent)
            if block_id is not None and self.blocks[block_id].token_ids == chunk and start + self.block_size < len(tokens):
                hits.append(block_id)
        return hashes, hits

    def plan_allocation(self, seq: Sequence) -> int | None:
        """Tokens the sequence would compute if admitted now, or None when the blocks are not there."""
        _, hits = self._prefix_hits(seq)
        free_hits = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        new_blocks = self.blocks_needed(len(seq)) - len(hits)
        if new_blocks > self.num_free_blocks - free_hits - self.watermark:
            return None
        return len(seq) - len(hits) * self.block_size

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing its cached prefix."""
        hashes, hits = self._prefix_hits(seq)
        for block_id in hits:
            self._take(block_id)
        seq.block_table = list(hits)
        for _ in range(self.blocks_needed(len(seq)) - len(hits)):
            seq.block_table.append(self._allocate_fresh())
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        self.seq_hashes[seq.seq_id] = _SeqHashes(hashes[: len(hits)])
        self.stats.queried_tokens += len(seq)
        self.stats.hit_tokens += seq.num_cached_tokens

    # ---- decode --------------------------------------------------------------------------------
    def can_append_slot(self, seq: Sequence) -> bool:
        return len(seq.block_table) * self.block_size >= len(seq) or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make room for the KV of the sequence's last token (position len(seq) - 1)."""
        if len(seq.block_table) * self.block_size < len(seq):
            seq.block_table.append(self._allocate_fresh())

    # ---- after the step ------------------------------------------------------------------------
    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register blocks that the step filled completely, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        state = self.seq_hashes[seq.seq_id]
        tokens = seq.all_token_ids
        num_full = seq.num_computed_tokens // self.block_size
        parent = state.hashes[-1] if state.hashes else seq.request.prefix_hash_seed
        for index in range(len(state.hashes), num_full):
            chunk = tuple(tokens[index * self.block_size : (index + 1) * self.block_size])
            parent = hash_block(parent, chunk)
            state.hashes.append(parent)
            block = self.blocks[seq.block_table[index]]
            if parent not in self.cached and block.hash is None:
                block.hash, block.token_ids = parent, chunk
                self.cached[parent] = block.block_id

    def free_seq(self, seq: Sequence) -> None:
        # reverse order: a sequence's tail blocks are the least likely to be shared, so evict them first
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        self.seq_hashes.pop(seq.seq_id, None)

    # ---- internals -----------------------------------------------------------------------------
    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _allocate_fresh(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict: its content is about to be overwritten
            del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id
