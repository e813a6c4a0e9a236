"""Tensor-parallel sharding of the layers, simulated in one process: the ranks' shards recombine to
the full layer, and each weight_loader slices the full Hugging Face tensor correctly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from data_plane.model.layers.activation import SiluAndMul
from data_plane.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from data_plane.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from data_plane.model.layers.norm import RMSNorm

HIDDEN = 32


def _load(layer: torch.nn.Module, name: str, tensor: torch.Tensor, shard_id: object = None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard_id)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_column_parallel_shards_concatenate(tp_size):
    """One output split across ranks (weight and bias alike): the ranks' outputs side by side are the full one."""
    w, b, x = torch.randn(8, HIDDEN), torch.randn(8), torch.randn(3, HIDDEN)
    outs = []
    for rank in range(tp_size):
        layer = MergedColumnParallelLinear(HIDDEN, [8], bias=True, tp_rank=rank, tp_size=tp_size)
        _load(layer, "weight", w, 0)
        _load(layer, "bias", b, 0)
        outs.append(layer(x))
    torch.testing.assert_close(torch.cat(outs, -1), F.linear(x, w, b))


@pytest.mark.parametrize("tp_size", [1, 2])
def test_merged_gate_up_per_rank(tp_size):
    gate, up, x = torch.randn(16, HIDDEN), torch.randn(16, HIDDEN), torch.randn(3, HIDDEN)
    full = F.silu(F.linear(x, gate)) * F.linear(x, up)
    outs = []
    for rank in range(tp_size):
        layer = MergedColumnParallelLinear(HIDDEN, [16, 16], tp_rank=rank, tp_size=tp_size)
        _load(layer, "weight", gate, 0)
        _load(layer, "weight", up, 1)
        outs.append(SiluAndMul()(layer(x, lora=None)))  # each rank's [gate shard | up shard] pairs up
    torch.testing.assert_close(torch.cat(outs, -1), full)


@pytest.mark.parametrize(("tp_size", "kv_replicas"), [(1, 1), (2, 1), (4, 2)])
def test_qkv_gqa_shards_and_replicated_kv_heads(tp_size, kv_replicas):
    heads, kv_heads, d = 4, 2, 8
    wq, wk, wv = torch.randn(heads * d, HIDDEN), torch.randn(kv_heads * d, HIDDEN), torch.randn(kv_heads * d, HIDDEN)
    bq, bk, bv = torch.randn(heads * d), torch.randn(kv_heads * d), torch.randn(kv_heads * d)
    x = torch.randn(3, HIDDEN)
    q_full, k_full, v_full = F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv)
    for rank in range(tp_size):
        layer = QKVParallelLinear(HIDDEN, d, heads, kv_heads, bias=True, tp_rank=rank, tp_size=tp_size)
        assert layer.kv_replicas == kv_replicas
        for sid, w, b in [("q", wq, bq), ("k", wk, bk), ("v", wv, bv)]:
            _load(layer, "weight", w, sid)
            _load(layer, "bias", b, sid)
        q, k, v = layer(x).split(layer.output_sizes_per_partition, -1)
        torch.testing.assert_close(q, q_full.chunk(tp_size, -1)[rank])
        kv_head = rank // kv_replicas  # ranks sharing a kv head hold the same copy
        n = layer.kv_size
        torch.testing.assert_close(k, k_full[:, kv_head * n : (kv_head + 1) * n])
        torch.testing.assert_close(v, v_full[:, kv_head * n : (kv_head + 1) * n])


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_row_parallel_partials_sum_to_full(tp_size):
    w, b, x = torch.randn(8, HIDDEN), torch.randn(8), torch.randn(3, HIDDEN)
    partial_sum = torch.zeros(3, 8)
    for rank, x_shard in enumerate(x.chunk(tp_size, -1)):
        layer = RowParallelLinear(HIDDEN, 8, bias=True, tp_rank=rank, tp_size=tp_size)
        _load(layer, "weight", w)
        _load(layer, "bias", b)
        partial_sum += F.linear(x_shard, layer.weight)  # what each rank contributes to the all-reduce
        torch.testing.assert_close(layer.bias, b)  # replicated, added once after the reduction
    torch.testing.assert_close(partial_sum + b, F.linear(x, w, b))
    if tp_size == 1:
        torch.testing.assert_close(layer(x), F.linear(x, w, b))


def test_vocab_parallel_shards_pad_the_last_rank():
    w = torch.randn(10, 4)
    rows = []
    for rank in range(3):  # 10 rows over 3 ranks: 4 + 4 + 2 real rows, 2 zero padding rows
        emb = VocabParallelEmbedding(10, 4, tp_rank=rank, tp_size=3)
        _load(emb, "weight", w)
        rows.append(emb.weight)
    padded = torch.cat(rows)
    torch.testing.assert_close(padded[:10], w)
    assert torch.all(padded[10:] == 0)


def test_embedding_and_tied_head_single_rank():
    w, h = torch.randn(10, 4), torch.randn(2, 4)
    emb = VocabParallelEmbedding(10, 4)
    _load(emb, "weight", w)
    head = ParallelLMHead(10, 4, shared_weight=emb.weight)
    torch.testing.assert_close(emb(torch.tensor([3, 7])), w[[3, 7]])
    logits = head(h)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, h @ w.T)


def test_shape_mismatch_and_bad_shard_id_raise():
    layer = QKVParallelLinear(HIDDEN, 8, 4, 2)
    with pytest.raises(ValueError, match="does not match"):
        _load(layer, "weight", torch.randn(8, HIDDEN), "q")
    with pytest.raises(ValueError, match="shard_id"):
        _load(layer, "weight", torch.randn(32, HIDDEN), "x")
    with pytest.raises(ValueError, match="not divisible"):
        MergedColumnParallelLinear(HIDDEN, [8, 6], tp_size=4)


def test_rmsnorm_matches_reference_in_bf16():
    norm = RMSNorm(HIDDEN, eps=1e-6)
    w = torch.rand(HIDDEN) + 0.5
    norm.weight.weight_loader(norm.weight, w)
    x = torch.randn(3, HIDDEN, dtype=torch.bfloat16)
    xf = x.float()
    expected = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    torch.testing.assert_close(norm(x), expected, atol=0, rtol=0)
