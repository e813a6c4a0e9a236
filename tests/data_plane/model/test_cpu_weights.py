"""How the loader lays linear weights out on the CPU (data_plane/model/layers/cpu_weights.py): packed
bfloat16 weights multiply exactly as the plain ones do and live once; on a CPU without half-precision
dot products (AVX2 only, forced) half-precision weights are widened to float32, multiply as the
half-precision GEMM does up to the order of its sums, and live once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from data_plane.model.layers.cpu_weights import LINEAR_WEIGHTS_ENV, prepare_cpu_weights
from data_plane.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from data_plane.model.layers.linear import LinearBase
from data_plane.model.layers.packed import can_pack, should_widen

REPO = Path(__file__).resolve().parents[3]


def _model(dtype: torch.dtype, tied: bool) -> tuple[nn.ModuleList, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    linear = LinearBase(64, 96, 64, 96, True, 0, 1)
    embed = VocabParallelEmbedding(300, 64)
    head = ParallelLMHead(300, 64, shared_weight=embed.weight if tied else None)
    with torch.no_grad():
        for p in (linear.weight, linear.bias, embed.weight, head.weight):
            p.data = torch.randn(p.shape).to(dtype)
    plain = {"linear": linear.weight.detach().clone(), "head": head.weight.detach().clone()}
    return nn.ModuleList([embed, linear, head]), plain


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="oneDNN has no bfloat16 path on this CPU")
@pytest.mark.parametrize("tied", [False, True])
def test_packed_bfloat16_weights_multiply_exactly_as_the_plain_ones_and_live_once(tied: bool) -> None:
    model, plain = _model(torch.bfloat16, tied)
    embed, linear, head = model
    x = torch.randn(5, 64).to(torch.bfloat16)
    expected_linear = F.linear(x, plain["linear"], linear.bias)
    expected_logits = F.linear(x, plain["head"]).float()
    assert prepare_cpu_weights(model) == "packed"
    assert torch.equal(linear(x), expected_linear)
    assert torch.equal(head(x), expected_logits)
    assert linear.weight.numel() == 0 and linear.weight.dtype == torch.bfloat16
    # a tied head's plain weight is the embedding's, which still looks tokens up
    assert (head.weight.numel() == 300 * 64) == tied
    if tied:
        assert torch.equal(embed(torch.tensor([3, 7])), plain["head"][[3, 7]])


def test_float32_weights_are_laid_out_column_major_and_plain_keeps_them(monkeypatch: pytest.MonkeyPatch) -> None:
    model, plain = _model(torch.float32, tied=False)
    linear = model[1]
    assert prepare_cpu_weights(model) == "column-major"
    assert linear.weight.stride() == (1, 96) and torch.equal(linear.weight, plain["linear"])
    model, _ = _model(torch.bfloat16, tied=False)
    monkeypatch.setenv(LINEAR_WEIGHTS_ENV, "plain")
    assert prepare_cpu_weights(model) == "plain"
    assert model[1].weight.stride() == (64, 1) and model[1].cpu_weight is None
    monkeypatch.setenv(LINEAR_WEIGHTS_ENV, "fast")
    with pytest.raises(ValueError, match=LINEAR_WEIGHTS_ENV):
        prepare_cpu_weights(model)


def _check_widened(dtype: torch.dtype, tied: bool) -> None:
    model, plain = _model(dtype, tied)
    embed, linear, head = model
    x = torch.randn(5, 64).to(dtype)
    assert prepare_cpu_weights(model) == "widened"
    # the half-precision GEMM's math: exact products, float32 sums, one rounding
    wide = F.linear(x.float(), plain["linear"].float(), linear.bias.float()).to(dtype)
    assert torch.equal(linear(x), wide)
    assert torch.equal(head(x), F.linear(x.float(), plain["head"].float()).to(dtype).float())
    # and torch's own half-precision matmul agrees to within the rounding of the sums' order
    torch.testing.assert_close(linear(x), F.linear(x, plain["linear"], linear.bias), rtol=1e-2, atol=1e-2)
    assert linear.weight.numel() == 0 and linear.weight.dtype == dtype
    assert linear.cpu_weight is not None and linear.cpu_weight.tensor.dtype == torch.float32
    assert (head.weight.numel() == 300 * 64) == tied
    if tied:
        assert torch.equal(embed(torch.tensor([3, 7])), plain["head"][[3, 7]])


@pytest.mark.parametrize("tied", [False, True])
def test_float16_weights_without_native_float16_are_widened_and_live_once(tied: bool) -> None:
    if not should_widen(torch.float16):
        pytest.skip("this CPU multiplies float16 natively (AVX-512 FP16 or AMX): float16 stays as loaded")
    _check_widened(torch.float16, tied)


def test_an_avx2_only_cpu_widens_bfloat16_weights() -> None:
    """ONEDNN_MAX_CPU_ISA=AVX2 (with ATen's AVX2 kernels) stands for an AVX2-only CPU on any host: bfloat16
    is not packed but widened, multiplies as the bfloat16 GEMM does, and the weight lives once."""
    script = ("import torch; from tests.data_plane.model.test_cpu_weights import _check_widened; "
              "_check_widened(torch.bfloat16, False); _check_widened(torch.bfloat16, True); print('checked')")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["checked"]
