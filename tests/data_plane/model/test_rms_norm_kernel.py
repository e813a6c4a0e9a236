"""The compiled CPU RMSNorm (data_plane/model/rms_norm_cpu.cpp) against the torch ops it replaces:
the residual add bit for bit, the norm within a unit in the last place, and rarely (only the order of the
sum of squares differs), for bfloat16 and float16, row widths with and without a vector tail, the vector path
and the plain loops (forced by building for ATen's DEFAULT capability)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data_plane.model.layers.norm import RMSNorm
from data_plane.model.norm_kernels import NORM_KERNELS_ENV, load_cpu_norm, select_norm_kernel

REPO = Path(__file__).resolve().parents[3]
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _norm(dtype: torch.dtype, hidden: int, kernel: object) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(hidden))
    norm.kernel = kernel  # type: ignore[assignment]
    return norm


def _assert_close_to_torch(got: torch.Tensor, expected: torch.Tensor) -> None:
    """One unit in the last place of the normalized value, scaled by the weight (|w| < 3 here) and
    rounded once more; and rare: only where the sum of squares rounded across a boundary."""
    a, b = got.float(), expected.float()
    assert torch.all((a - b).abs() <= 3 * ULP[got.dtype] * b.abs() + 1e-6), (a - b).abs().max()
    assert (a != b).float().mean() < 0.01


def check_kernel_matches_torch() -> None:
    kernel = load_cpu_norm()
    assert kernel is not None, "the RMSNorm kernel did not build"
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for rows, hidden in ((1, 1024), (5, 1000), (64, 64), (300, 520)):
            fused, plain = _norm(dtype, hidden, kernel), _norm(dtype, hidden, None)
            plain.weight.data.copy_(fused.weight.data)
            x = (3 * torch.randn(rows, hidden)).to(dtype)
            residual = torch.randn(rows, hidden).to(dtype)
            _assert_close_to_torch(fused(x), plain(x))
            expected_out, expected_residual = plain.add_forward(x, residual.clone())
            got_out, got_residual = fused.add_forward(x, residual.clone())
            assert torch.equal(got_residual, expected_residual)  # the add: one rounding, as torch's
            _assert_close_to_torch(got_out, expected_out)


def test_the_kernel_matches_the_torch_ops() -> None:
    check_kernel_matches_torch()


def test_the_plain_loops_match_the_torch_ops(tmp_path: Path) -> None:
    """ATEN_CPU_CAPABILITY=default builds the kernel without AVX2: the path of a CPU that lacks it."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "PYTHONPATH": str(REPO),
           "LORAPLANE_KERNEL_BUILD_DIR": os.environ.get("LORAPLANE_KERNEL_BUILD_DIR", str(REPO / ".loraplane" / "build"))}
    script = ("import torch; assert torch.backends.cpu.get_cpu_capability() == 'DEFAULT'; "
              "from tests.data_plane.model.test_rms_norm_kernel import check_kernel_matches_torch as c; c(); print('ok')")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok"]


def test_float32_and_the_torch_switch_take_the_torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    assert select_norm_kernel(torch.device("cpu"), torch.float32) is None
    assert select_norm_kernel(torch.device("cpu"), torch.bfloat16) is not None
    monkeypatch.setenv(NORM_KERNELS_ENV, "torch")
    assert select_norm_kernel(torch.device("cpu"), torch.bfloat16) is None
    monkeypatch.setenv(NORM_KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match=NORM_KERNELS_ENV):
        select_norm_kernel(torch.device("cpu"), torch.bfloat16)
