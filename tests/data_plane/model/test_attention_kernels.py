"""The compiled CPU decode attention against the torch path (gather + SDPA) on random shapes, context
lengths, block tables, GQA groups and head sizes, in every dtype the engine serves; what it refuses; the
switch that forces the torch path; the loader's choice (the fallback: test_cpu_extension.py)."""

from __future__ import annotations

import random

import pytest
import torch

from data_plane.model.attention import PagedAttention
from data_plane.model.attention_kernels import (
    ATTENTION_KERNELS_ENV,
    load_cpu_decode_attention,
    select_decode_attention,
)
from data_plane.model.attention_metadata import DecodeEntry, PrefillEntry, build_attention_metadata
from data_plane.model.loader import load_model

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def kernel():
    built = load_cpu_decode_attention()
    assert built is not None, "the CPU attention kernel did not build (a compiler and ninja are installed here)"
    return built


def _case(rng: random.Random, dtype: torch.dtype):
    """A layer geometry, a shuffled KV cache and a step of decodes (and sometimes a prefill beside them)."""
    kv_heads = rng.choice([1, 2, 4])
    heads = kv_heads * rng.choice([1, 2, 4, 7])
    dim = rng.choice([8, 24, 64, 80, 128])  # multiples of 16 take the vector loops, the rest their tails
    block_size = rng.choice([1, 4, 16])
    lens = [rng.randint(1, 70) for _ in range(rng.randint(1, 9))]
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + rng.randint(1, 5)
    order = rng.sample(range(num_blocks), num_blocks)  # blocks scattered over the cache, as after reuse
    tables, at = [], 0
    for n in need:
        tables.append(order[at : at + n])
        at += n
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    cache = (torch.randn(2, num_blocks * block_size, kv_heads, dim, generator=g) * 2).to(dtype)
    decode = [DecodeEntry(t, n) for t, n in zip(tables, lens, strict=True)]
    prefill = [PrefillEntry(order[at : at + 1], 0, 1)] if rng.random() < 0.3 and at < num_blocks else []
    tokens = len(decode) + len(prefill)
    qkv = [(torch.randn(tokens, w, generator=g) * 2).to(dtype) for w in (heads * dim, kv_heads * dim, kv_heads * dim)]
    layer = PagedAttention(heads, kv_heads, dim, dim**-0.5)
    return layer, cache, build_attention_metadata(decode, prefill, block_size, CPU), qkv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kernel_matches_the_torch_path(kernel, dtype):
    rng = random.Random(f"attention-{dtype}")
    for _ in range(40):
        layer, cache, meta, (q, k, v) = _case(rng, dtype)
        torch_cache, kernel_cache = cache.clone(), cache.clone()
        expected = layer(q, k, v, torch_cache, meta)
        layer.decode_kernel = kernel
        got = layer(q, k, v, kernel_cache, meta)
        torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        assert torch.equal(kernel_cache, torch_cache)  # the step's new K/V written alike, then read in place


def test_a_query_sees_exactly_its_own_context(kernel):
    """Changing a key past a sequence's length, or in another sequence's blocks, changes nothing."""
    layer = PagedAttention(4, 2, 16, 0.25)
    layer.decode_kernel = kernel
    cache = torch.randn(2, 8 * 4, 2, 16)
    meta = build_attention_metadata([DecodeEntry([3, 1], 5), DecodeEntry([0], 2)], [], 4, CPU)
    q, k, v = torch.randn(2, 64), torch.randn(2, 32), torch.randn(2, 32)
    before = layer(q, k, v, cache, meta)
    for slot in (1 * 4 + 1, 0 * 4 + 3, 7 * 4):  # past seq 0's fifth token, past seq 1's second, an unused block
        cache[:, slot] += 100.0
    torch.testing.assert_close(layer(q, k, v, cache, meta), before, rtol=0, atol=0)


def test_bad_tables_and_shapes_are_refused(kernel):
    q, out = torch.randn(1, 4, 16), torch.empty(1, 4, 16)
    cache = torch.randn(2, 8, 2, 16)
    lens = torch.tensor([3])
    with pytest.raises(RuntimeError, match="block out of range"):
        kernel(out, q, cache, torch.tensor([[2]]), lens, 4, 0.25)  # the cache holds blocks 0 and 1
    with pytest.raises(RuntimeError, match="context length"):
        kernel(out, q, cache, torch.tensor([[0]]), torch.tensor([5]), 4, 0.25)  # 5 tokens in one block of 4
    with pytest.raises(RuntimeError, match="dtype"):
        kernel(out, q, cache.double(), torch.tensor([[0]]), lens, 4, 0.25)


def test_the_switch_forces_the_torch_path(monkeypatch, kernel):
    monkeypatch.setenv(ATTENTION_KERNELS_ENV, "torch")
    assert select_decode_attention(CPU) is None
    monkeypatch.setenv(ATTENTION_KERNELS_ENV, "auto")
    assert select_decode_attention(CPU) is kernel
    assert select_decode_attention(torch.device("meta")) is None  # not a CPU: the torch path
    monkeypatch.setenv(ATTENTION_KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match=ATTENTION_KERNELS_ENV):
        select_decode_attention(CPU)


def test_the_loader_puts_the_choice_on_every_layer(monkeypatch, kernel, tiny_checkpoints):
    for choice, expected in (("auto", kernel), ("torch", None)):
        monkeypatch.setenv(ATTENTION_KERNELS_ENV, choice)
        model, _ = load_model(tiny_checkpoints["llama"])
        layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        assert layers and all(m.decode_kernel is expected for m in layers)
