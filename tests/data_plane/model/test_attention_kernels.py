"""The compiled CPU decode attention against the torch path (gather + SDPA) on random shapes, context
lengths, block tables, GQA groups and head sizes, in every dtype the engine serves, on this CPU's build
and on the AVX2 and plain builds forced with ATEN_CPU_CAPABILITY; bf16 and fp16 against a float32
reference of the same inputs; what it refuses; the switch that forces the torch path; the loader's
choice (the fallback: test_cpu_extension.py)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

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


FORCED = "ATEN_CPU_CAPABILITY"  # set by test_each_instruction_set_serves_alike for the run it starts


def test_the_build_is_the_forced_instruction_set():
    """Under a forced capability, torch (and so the kernel's build flags and cache folder) follows it."""
    if FORCED not in os.environ:
        pytest.skip(f"{FORCED} not set: the build is this CPU's own")
    assert torch.backends.cpu.get_cpu_capability() == os.environ[FORCED].upper()


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_accumulates_in_float_and_rounds_once(kernel, dtype):
    """bf16 / fp16 inputs give the float32 torch path's result on the same (upcast) inputs within one
    rounding to the dtype, and bit for bit the float32 kernel's result on them rounded to nearest even
    (as torch's .to rounds): the half-precision rows take the float path's loops, converted as loaded."""
    rng = random.Random(f"rounded-{dtype}")
    for _ in range(40):
        layer, cache, meta, (q, k, v) = _case(rng, dtype)
        half_cache, float_cache = cache.clone(), cache.float()
        expected = layer(q.float(), k.float(), v.float(), float_cache.clone(), meta)  # torch, float32
        layer.decode_kernel = kernel
        got = layer(q, k, v, half_cache, meta)
        nd = meta.num_decode_tokens
        step = torch.finfo(dtype).eps / 2 * 1.01  # half a unit in the last place, relative, and float error
        torch.testing.assert_close(got[:nd].float(), expected[:nd], rtol=step, atol=1e-5)
        in_float = layer(q.float(), k.float(), v.float(), float_cache, meta)
        assert torch.equal(got[:nd], in_float[:nd].to(dtype))


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


@pytest.mark.skipif(FORCED in os.environ, reason="the run started by this test")
@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_each_instruction_set_serves_alike(capability):
    """The AVX2 build (a CPU without AVX-512) and the plain one (no SIMD) pass the same tests against the
    torch path in every dtype, in a process whose torch is forced to that capability; each build has its
    own cache folder, so the first run compiles it."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}, FORCED: capability}
    root = Path(__file__).resolve().parents[3]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
         "forced_instruction_set or matches_the_torch_path or rounds_once or own_context"],
        cwd=root, env=env, capture_output=True, text=True, timeout=540,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "7 passed" in run.stdout, run.stdout[-2000:]
