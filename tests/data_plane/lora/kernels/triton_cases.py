"""The cases of test_triton.py, run in a process of their own: TRITON_INTERPRET=1 has to be set before
triton is first imported (peft imports it, so a test process has it long before), and a loaded triton
cannot be imported again. `python -m tests.data_plane.lora.kernels.triton_cases` prints one line per case.
"""

from __future__ import annotations

import os
import random
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: its own library is decorated then too

import torch  # noqa: E402
import triton.language.standard  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from data_plane.lora.kernels.triton_ops import load_triton_kernels  # noqa: E402
from data_plane.lora.ops import TORCH_KERNELS, lora_expand, lora_shrink, lora_shrink_expand  # noqa: E402
from data_plane.model.lora_batch import LoRABatch  # noqa: E402

CPU = torch.device("cpu")


def _layer(g: torch.Generator, num_slots: int, dim: int, widths: list[int], padded: int, rank: int):
    a = torch.zeros(num_slots, dim, len(widths), padded)
    a[..., :rank] = torch.randn(num_slots, dim, len(widths), rank, generator=g)  # zero past the rank
    b = torch.zeros(num_slots, padded, sum(widths))
    b[:, :rank] = torch.randn(num_slots, rank, sum(widths), generator=g)
    lanes = [(sum(widths[:i]), w) for i, w in enumerate(widths)]
    return a.view(num_slots, dim, -1), b, lanes


def bgmv_and_sgmv_match_the_torch_ops(kernels, seed: int) -> None:
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    num_slots, padded = rng.randint(2, 4), rng.choice([8, 16])
    rank, widths, dim = rng.randint(1, padded), [rng.randint(3, 70) for _ in range(rng.choice([1, 3]))], rng.randint(5, 90)
    a, b, lanes = _layer(g, num_slots, dim, widths, padded, rank)
    decode = [rng.randint(-1, num_slots - 1) for _ in range(5)] + [0, -1]  # -1: base-model tokens
    prefill = [1] * rng.randint(1, 20) + [-1] * 2 + [0] * rng.randint(1, 5)  # a segment longer than BLOCK_M
    token_slots = decode + prefill
    x = torch.randn(len(token_slots), dim, generator=g)
    y = torch.randn(len(token_slots), sum(widths), generator=g)
    batch = LoRABatch.build(token_slots, len(decode), rank, CPU)
    want, got = y.clone(), y.clone()
    lora_shrink_expand(want, x, a, b, lanes, batch, TORCH_KERNELS)
    lora_shrink_expand(got, x, a, b, lanes, batch, kernels)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    base = [t for t, s in enumerate(token_slots) if s < 0]
    assert torch.equal(got[base], y[base])
    v = lora_shrink(x, a, len(lanes), batch, kernels)  # the row-parallel path's two halves
    torch.testing.assert_close(v, lora_shrink(x, a, len(lanes), batch, TORCH_KERNELS), atol=1e-5, rtol=1e-5)
    got = y.clone()
    lora_expand(got, v, b, lanes, batch, kernels)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def bgmv_skips_slot_minus_one_and_reads_strided_slots(kernels) -> None:
    g = torch.Generator().manual_seed(7)
    pool = torch.randn(3, 8 * 16 + 9, generator=g)  # slot stride wider than a slot's rows, as in a slot pool
    a = pool[:, : 8 * 16].view(3, 8, 16)
    x, v = torch.randn(3, 8, generator=g), torch.full((3, 16), 5.0)
    kernels.bgmv_shrink(v, x, a, torch.tensor([0, 1, 2]), torch.tensor([2, -1, 1]), 1, 16)
    torch.testing.assert_close(v[0], x[0] @ a[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v[2], x[2] @ a[1], atol=1e-5, rtol=1e-5)
    assert torch.equal(v[1], torch.full((16,), 5.0))


def bf16_matches_within_its_precision(kernels) -> None:
    g = torch.Generator().manual_seed(3)
    a, b, lanes = _layer(g, 2, 24, [20, 12], 8, 8)
    token_slots = [1, 0, -1, 1, 1, 1]
    batch = LoRABatch.build(token_slots, 3, 8, CPU)
    x, y = torch.randn(6, 24, generator=g), torch.randn(6, 32, generator=g)
    args = [t.to(torch.bfloat16) for t in (x, a, b)]
    want, got = y.to(torch.bfloat16), y.to(torch.bfloat16)
    lora_shrink_expand(want, args[0], args[1], args[2], lanes, batch, TORCH_KERNELS)
    lora_shrink_expand(got, args[0], args[1], args[2], lanes, batch, kernels)
    torch.testing.assert_close(got.float(), want.float(), atol=0.1, rtol=2e-2)


def main() -> int:
    assert isinstance(triton.language.standard.zeros, InterpretedFunction), "triton is not in interpreter mode"
    kernels = load_triton_kernels()
    for seed in range(3):
        bgmv_and_sgmv_match_the_torch_ops(kernels, seed)
        print(f"ok bgmv_and_sgmv_match_the_torch_ops[{seed}]")
    for case in (bgmv_skips_slot_minus_one_and_reads_strided_slots, bf16_matches_within_its_precision):
        case(kernels)
        print(f"ok {case.__name__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
