"""The CUDA LoRA kernels (Triton) against the pure-torch ops on the CPU, in Triton's interpreter: fp32 to
1e-5 on random shapes, ranks, lanes, slots and base tokens, BGMV and SGMV, both halves apart (the
row-parallel path), strided slots, slot -1, bf16. The cases run in a child process (triton_cases.py says
why); the interpreter runs each program in Python, so they stay small."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).parents[4]
CASES = ["bgmv_and_sgmv_match_the_torch_ops[0]", "bgmv_and_sgmv_match_the_torch_ops[1]",
         "bgmv_and_sgmv_match_the_torch_ops[2]", "bgmv_skips_slot_minus_one_and_reads_strided_slots",
         "bf16_matches_within_its_precision"]


def test_triton_kernels_match_the_torch_ops_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "tests.data_plane.lora.kernels.triton_cases"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split() == [word for case in CASES for word in ("ok", case)]
