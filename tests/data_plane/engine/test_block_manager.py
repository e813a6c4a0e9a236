"""Block manager: allocation, prefix hits isolated by seed, reference counts, LRU eviction."""

from __future__ import annotations

from data_plane.engine.block_manager import BlockManager, hash_block
from data_plane.engine.sampling_params import SamplingParams
from data_plane.engine.sequence import Request, Sequence

_ids = iter(range(10_000))


def _seq(tokens: list[int], seed: int = 0) -> Sequence:
    return Sequence(next(_ids), Request("r", tokens, SamplingParams(), prefix_hash_seed=seed), 0)


def _prefill(bm: BlockManager, seq: Sequence) -> None:
    bm.allocate(seq)
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq)


def test_hash_chain_depends_on_parent_and_tokens():
    assert hash_block(0, (1, 2)) != hash_block(1, (1, 2))
    assert hash_block(0, (1, 2)) != hash_block(0, (2, 1))
    assert hash_block(0, (1, 2)) == hash_block(0, (1, 2))


def test_prefix_hit_shares_blocks_and_keeps_last_token_uncached():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = _seq(list(range(1, 13)))  # exactly three full blocks
    _prefill(bm, a)
    b = _seq(list(range(1, 13)))
    bm.allocate(b)
    # the last token must be computed to be sampled, so only two of three blocks are reused
    assert b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.blocks[a.block_table[0]].ref_count == 2


def test_seed_isolates_namespaces():
    bm = BlockManager(num_blocks=16, block_size=4)
    _prefill(bm, _seq(list(range(1, 14)), seed=0))
    other = _seq(list(range(1, 14)), seed=12345)
    bm.allocate(other)
    assert other.num_cached_tokens == 0
    same = _seq(list(range(1, 14)), seed=0)
    bm.allocate(same)
    assert same.num_cached_tokens == 12


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=6, block_size=4)
    bm.watermark = 0
    first = _seq(list(range(1, 10)))  # 3 blocks, 2 full
    _prefill(bm, first)
    bm.free_seq(first)
    assert bm.num_free_blocks == 6 and len(bm.cached) == 2
    again = _seq(list(range(1, 10)))
    assert bm.plan_allocation(again) == 1
    bm.allocate(again)
    assert again.num_cached_tokens == 8
    bm.free_seq(again)
    # a big unrelated sequence takes every block: all cached prefixes are evicted
    big = _seq(list(range(100, 124)))
    bm.allocate(big)
    assert bm.num_free_blocks == 0 and not any(b.hash is not None and b.ref_count == 0 for b in bm.blocks)
    bm.free_seq(big)
    late = _seq(list(range(1, 10)))
    bm.allocate(late)
    assert late.num_cached_tokens == 0


def test_plan_allocation_refuses_beyond_free_blocks():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.plan_allocation(_seq(list(range(1, 30)))) is None
    assert bm.plan_allocation(_seq([1, 2, 3])) == 3


def test_append_slot_allocates_at_block_boundary():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = _seq([1, 2, 3, 4])
    _prefill(bm, seq)
    seq.output_token_ids.append(9)  # position 4 needs a second block
    assert bm.can_append_slot(seq)
    bm.append_slot(seq)
    assert len(seq.block_table) == 2
