"""Paged attention against plain causal SDPA over the same keys (GQA expanded by hand), with the decode
tokens through the torch path and through the compiled CPU kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from data_plane.model.attention import PagedAttention
from data_plane.model.attention_kernels import load_cpu_decode_attention
from data_plane.model.attention_metadata import (
    FOLDED_CHUNK_TOKENS,
    DecodeEntry,
    PrefillEntry,
    build_attention_metadata,
)

H, HKV, D, BS = 4, 2, 8, 4
CPU = torch.device("cpu")


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one whole sequence: q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]."""
    t = q.shape[0]
    q = q.view(t, H, D).transpose(0, 1)
    k = k.view(t, HKV, D).transpose(0, 1).repeat_interleave(H // HKV, 0)
    v = v.view(t, HKV, D).transpose(0, 1).repeat_interleave(H // HKV, 0)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(t, H * D)


def _qkv(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(n, H * D), torch.randn(n, HKV * D), torch.randn(n, HKV * D)


@pytest.fixture(params=["torch", "cpu-kernel"])
def attn(request) -> PagedAttention:
    torch.manual_seed(0)
    layer = PagedAttention(H, HKV, D, D**-0.5)
    if request.param == "cpu-kernel":
        layer.decode_kernel = load_cpu_decode_attention()
        assert layer.decode_kernel is not None, "the CPU attention kernel did not build (a compiler is installed here)"
    return layer


def _step(attn, cache, decode, prefill, qkvs):
    meta = build_attention_metadata(decode, prefill, BS, CPU)
    q, k, v = (torch.cat(parts) for parts in zip(*qkvs, strict=True))
    return attn(q, k, v, cache, meta)


@pytest.mark.parametrize("lengths", [(10, 6), (8, 8)])  # unequal (masked) and equal (mask-free) lengths
def test_prefill_then_decode_match_reference(attn, lengths):
    cache = torch.zeros(2, 64, HKV, D)
    tables = [[3, 5, 7], [1, 2, 9]]
    seqs = [_qkv(n + 1) for n in lengths]
    prefill = [PrefillEntry(t, 0, n) for t, n in zip(tables, lengths, strict=True)]
    out = _step(attn, cache, [], prefill, [tuple(x[:n] for x in s) for s, n in zip(seqs, lengths, strict=True)])
    start = 0
    for s, n in zip(seqs, lengths, strict=True):
        torch.testing.assert_close(out[start : start + n], _reference(*(x[:n] for x in s)), atol=1e-5, rtol=1e-5)
        start += n
    decode = [DecodeEntry(t, n + 1) for t, n in zip(tables, lengths, strict=True)]
    out = _step(attn, cache, decode, [], [tuple(x[n : n + 1] for x in s) for s, n in zip(seqs, lengths, strict=True)])
    for row, s in enumerate(seqs):
        torch.testing.assert_close(out[row], _reference(*s)[-1], atol=1e-5, rtol=1e-5)


def test_cached_prefix_and_mixed_decode_prefill(attn):
    cache = torch.zeros(2, 64, HKV, D)
    a, b = _qkv(11), _qkv(6)
    # b's first 4 tokens are in the cache already (a prefix hit), then a decodes while b prefills
    _step(attn, cache, [], [PrefillEntry([1, 2], 0, 4)], [tuple(x[:4] for x in b)])
    _step(attn, cache, [], [PrefillEntry([3, 5, 7], 0, 10)], [tuple(x[:10] for x in a)])
    out = _step(
        attn, cache, [DecodeEntry([3, 5, 7], 11)], [PrefillEntry([1, 2], 4, 2)],
        [tuple(x[10:] for x in a), tuple(x[4:] for x in b)],
    )
    torch.testing.assert_close(out[0], _reference(*a)[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1:], _reference(*b)[4:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fold", [False, True])
def test_short_chunks_of_cached_prompts_as_decode_rows_match_reference(attn, fold):
    """A decode beside two continuing chunks (the first short enough to fold into decode rows, the second
    not) and a fresh prompt: each token's output is the reference's, folded or gathered."""
    cache = torch.zeros(2, 256, HKV, D)
    a, b, c, d = _qkv(9), _qkv(12 + FOLDED_CHUNK_TOKENS), _qkv(12 + FOLDED_CHUNK_TOKENS + 2), _qkv(5)
    ta, tb, tc, td = [0, 1, 2], [3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18], [19, 20]
    _step(attn, cache, [], [PrefillEntry(ta, 0, 8), PrefillEntry(tb, 0, 12), PrefillEntry(tc, 0, 12)],
          [tuple(x[:8] for x in a), tuple(x[:12] for x in b), tuple(x[:12] for x in c)])
    decode = [DecodeEntry(ta, 9)]
    prefill = [PrefillEntry(tb, 12, FOLDED_CHUNK_TOKENS), PrefillEntry(tc, 12, FOLDED_CHUNK_TOKENS + 2), PrefillEntry(td, 0, 5)]
    meta = build_attention_metadata(decode, prefill, BS, CPU, fold_chunks=fold and attn.decode_kernel is not None)
    parts = [tuple(x[8:] for x in a), tuple(x[12:] for x in b), tuple(x[12:] for x in c), d]
    q, k, v = (torch.cat(p) for p in zip(*parts, strict=True))
    out = attn(q, k, v, cache, meta)
    if fold and attn.decode_kernel is not None:
        assert meta.num_decode_tokens == 1 + FOLDED_CHUNK_TOKENS and meta.num_prefill_seqs == 2  # b's chunk is rows, c's is not
    expected = torch.cat([_reference(*a)[8:], _reference(*b)[12:], _reference(*c)[12:], _reference(*d)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
