"""The compiled CPU kernels against the pure-torch ops on random shapes, ranks, slots and lanes, in every
dtype the engine serves; the switch that forces the torch ops (the fallback when they cannot be built:
tests/data_plane/model/test_cpu_extension.py)."""

from __future__ import annotations

import random

import pytest
import torch

from data_plane.lora.kernels.cpu import CPUKernels, load_cpu_kernels
from data_plane.lora.kernels.select import KERNELS_ENV, select_kernels
from data_plane.lora.ops import TORCH_KERNELS, lora_expand, lora_shrink, lora_shrink_expand
from data_plane.model.lora_batch import LoRABatch

CPU = torch.device("cpu")
OPS = torch.ops.loraplane_lora  # the compiled ops themselves, once the fixture has built them
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def kernels() -> CPUKernels:
    built = load_cpu_kernels()
    assert built is not None, "the CPU kernels did not build (compiler and ninja are installed here)"
    return built


def _case(rng: random.Random, dtype: torch.dtype):
    """A layer (slots, lanes of random widths, padded rank) and a step of mixed decode and prefill tokens."""
    num_slots, padded = rng.randint(1, 5), rng.choice([4, 8, 16])
    rank = rng.randint(1, padded)
    widths = [rng.randint(1, 40) for _ in range(rng.choice([1, 2, 3]))]
    lanes = [(sum(widths[:i]), w) for i, w in enumerate(widths)]
    dim = rng.randint(1, 70)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    a = torch.zeros(num_slots, dim, len(lanes), padded)
    a[..., :rank] = torch.randn(num_slots, dim, len(lanes), rank, generator=g)  # zero past the rank, as slots are
    b = torch.zeros(num_slots, padded, sum(widths))
    b[:, :rank] = torch.randn(num_slots, rank, sum(widths), generator=g)
    decode = [rng.randint(-1, num_slots - 1) for _ in range(rng.randint(0, 9))]  # -1: a base-model token
    prefill = [s for _ in range(rng.randint(0, 3)) for s in [rng.randint(-1, num_slots - 1)] * rng.randint(1, 6)]
    token_slots = decode + prefill
    if set(token_slots) <= {-1} or len(set(token_slots)) == 1:
        token_slots = [0, -1] + token_slots  # something mixed for the kernels to do
        decode = [0, -1] + decode
    x = torch.randn(len(token_slots), dim, generator=g)
    y = torch.randn(len(token_slots), sum(widths), generator=g)
    batch = LoRABatch.build(token_slots, len(decode), rank, CPU)
    cast = lambda t: t.to(dtype)  # noqa: E731
    return cast(x), cast(y), cast(a.view(num_slots, dim, -1)), cast(b), lanes, batch, token_slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernels_match_the_torch_ops_on_random_steps(kernels, dtype):
    rng = random.Random(str(dtype))
    for _ in range(40):
        x, y, a, b, lanes, batch, token_slots = _case(rng, dtype)
        want, got = y.clone(), y.clone()
        lora_shrink_expand(want, x, a, b, lanes, batch, TORCH_KERNELS)
        lora_shrink_expand(got, x, a, b, lanes, batch, kernels)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(got, want, atol=tol * 4, rtol=tol)
        base = [t for t, s in enumerate(token_slots) if s < 0]
        assert torch.equal(got[base], y[base])  # base tokens untouched, bit for bit
        # the row-parallel path: shrink and expand as two calls, v between them
        v_want, v_got = lora_shrink(x, a, len(lanes), batch, TORCH_KERNELS), lora_shrink(x, a, len(lanes), batch, kernels)
        torch.testing.assert_close(v_got, v_want, atol=tol * 4, rtol=tol)
        got = y.clone()
        lora_expand(got, v_want, b, lanes, batch, kernels)
        torch.testing.assert_close(got, want, atol=tol * 4, rtol=tol)



def _wide_case(g: torch.Generator, padded: int, rank: int, widths: list[int], dim: int, num_slots: int = 3):
    """A layer the size of a real model's (more than one block of A's and of B's columns per lane), with
    decode tokens of mixed slots and two prefill segments."""
    a = torch.zeros(num_slots, dim, len(widths), padded)
    a[..., :rank] = torch.randn(num_slots, dim, len(widths), rank, generator=g)
    b = torch.zeros(num_slots, padded, sum(widths))
    b[:, :rank] = torch.randn(num_slots, rank, sum(widths), generator=g)
    lanes = [(sum(widths[:i]), w) for i, w in enumerate(widths)]
    decode = [1, 2, -1, 0, 2]  # slots 0 and 1 alone: a pair of two slots; slot 2's two tokens share a tile
    token_slots = decode + [1] * 7 + [-1] * 2 + [2] * 9  # prefill runs cut into tiles of 4, 2 and 1 tokens
    batch = LoRABatch.build(token_slots, len(decode), rank, CPU)
    x, y = torch.randn(len(token_slots), dim, generator=g), torch.randn(len(token_slots), sum(widths), generator=g)
    return x, y, a.view(num_slots, dim, -1), b, lanes, batch


@pytest.mark.parametrize(("padded", "rank", "widths", "dim"), [
    (64, 64, [512, 128, 128], 512),  # qkv of rank 64: A's rows split into three 64-column passes
    (64, 37, [300, 77], 1408),  # a rank below the padding: per lane, with a tail of 5 columns
    (16, 16, [1408], 600),
    (8, 3, [5, 9, 130], 9),
])
def test_kernels_match_the_torch_ops_on_model_sized_layers(kernels, padded, rank, widths, dim):
    x, y, a, b, lanes, batch = _wide_case(torch.Generator().manual_seed(rank), padded, rank, widths, dim)
    want, got = y.clone(), y.clone()
    lora_shrink_expand(want, x, a, b, lanes, batch, TORCH_KERNELS)
    lora_shrink_expand(got, x, a, b, lanes, batch, kernels)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-5)  # sums of ~10^4 products of order 1


@pytest.mark.parametrize("slot_dtype", [torch.bfloat16, torch.float16])
def test_half_width_slots_under_float32_activations_are_the_rounded_weights_in_float32(kernels, slot_dtype):
    """--lora-dtype: slots in bfloat16/float16, x and y in float32. The kernels (and the torch ops, by a
    copy) compute exactly the float32 math on the rounded weights."""
    rng = random.Random(str(slot_dtype))
    cases = [_case(rng, torch.float32)[:6] for _ in range(40)]
    cases.append(_wide_case(torch.Generator().manual_seed(1), 16, 16, [512, 128, 128], 512))
    for x, y, a, b, lanes, batch in cases:
        narrow_a, narrow_b = a.to(slot_dtype), b.to(slot_dtype)
        want = y.clone()
        lora_shrink_expand(want, x, narrow_a.float(), narrow_b.float(), lanes, batch, TORCH_KERNELS)
        for backend in (kernels, TORCH_KERNELS):
            got = y.clone()
            lora_shrink_expand(got, x, narrow_a, narrow_b, lanes, batch, backend)
            # float32 sums in another order: the error grows with the sum's length (512 in the wide case,
            # where this CPU's kernel differed from the torch ops by 1.4e-4 on a value of 3.8)
            torch.testing.assert_close(got, want, atol=1e-4 * max(1, x.shape[1] // 64), rtol=1e-5)
    with pytest.raises(RuntimeError, match="not supported|float32 activations"):  # half activations, other slots
        OPS.bgmv_shrink(torch.zeros(1, 4, dtype=torch.bfloat16), torch.zeros(1, 8, dtype=torch.bfloat16),
                            torch.zeros(1, 8, 4, dtype=torch.float16), torch.tensor([0]), torch.tensor([0]), 1, 4)

def test_slot_minus_one_and_strided_slots_are_read_in_place(kernels):
    # a slot-major view with a slot stride wider than its rows, as a shared slot pool would hold them
    pool = torch.randn(3, 2 * 8 * 4 + 5)
    a = pool[:, : 8 * 4].view(3, 8, 4)  # [slots, in, 1 lane * R=4]
    x, v = torch.randn(4, 8), torch.full((4, 4), 7.0)
    index, slots = torch.tensor([0, 1, 2, 3]), torch.tensor([2, -1, 0, -1])
    OPS.bgmv_shrink(v, x, a, index, slots, 1, 4)
    torch.testing.assert_close(v[0], x[0] @ a[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v[2], x[2] @ a[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(v[[1, 3]], torch.full((2, 4), 7.0))  # slot -1: the row is not written


def test_bad_routing_is_refused_not_read_out_of_bounds(kernels):
    a, x, v = torch.zeros(2, 8, 4), torch.zeros(3, 8), torch.zeros(3, 4)
    with pytest.raises(RuntimeError, match="slot 2 out of range"):
        OPS.bgmv_shrink(v, x, a, torch.tensor([0]), torch.tensor([2]), 1, 4)
    with pytest.raises(RuntimeError, match="token index 3 out of range"):
        OPS.bgmv_shrink(v, x, a, torch.tensor([3]), torch.tensor([0]), 1, 4)


def test_env_forces_the_torch_ops_and_auto_picks_the_kernels(monkeypatch, kernels):
    monkeypatch.setenv(KERNELS_ENV, "torch")
    assert select_kernels(CPU) is TORCH_KERNELS
    monkeypatch.setenv(KERNELS_ENV, "auto")
    assert isinstance(select_kernels(CPU), CPUKernels)
    monkeypatch.setenv(KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="LORAPLANE_LORA_KERNELS"):
        select_kernels(CPU)
