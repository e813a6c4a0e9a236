"""Tensor parallelism on CPU (gloo, 2 ranks): greedy tokens equal one device, base and adapters alike.

Each engine runs in its own process (tp_driver.py); rank 0 of the TP=2 engine spawns rank 1.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from data_plane.demo.tokenizer_builder import write_tokenizer
from tests.data_plane.checkpoints import write_tiny_checkpoint
from tests.data_plane.peft_adapters import write_peft_adapter

REPO = Path(__file__).resolve().parents[3]
KINDS = ["patterns", "rslora", "attention"]


def _drive(spec: dict, **engine) -> dict:
    spec = {**spec, "engine": {"max_loras": 2, "max_lora_rank": 64, **engine}}
    result = subprocess.run(
        [sys.executable, "-m", "tests.data_plane.engine.tp_driver", json.dumps(spec)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(rng.randrange(3, 20))] for _ in range(n)]


def _spec(model: Path, adapters: list[Path]) -> dict:
    p = _prompts(4, seed=21)
    alone = [[[f"alone{i}", p[i % 4], i]] for i in range(len(adapters) + 1)]  # base (0) and each adapter
    # each adapter alone once more, in the same cycle: with max_loras=2 < 3 adapters, whatever the slot
    # policy, an adapter comes back after its slot went to another, so slots are rewritten on every rank
    again = [[[f"again{i}", p[(i + 1) % 4], i]] for i in range(1, len(adapters) + 1)]
    mixed = [[f"mixed{i}-{j}", p[j], i] for j in range(2) for i in range(len(adapters) + 1)]
    # adapter 1 is then removed (unloaded) and must be absent from its slot while the others still serve
    after = [[f"after{i}", p[3], i] for i in range(2, len(adapters) + 1)]
    return {"model": str(model), "adapters": [str(a) for a in adapters], "max_tokens": 12,
            "phases": [*alone, *again, mixed, after], "unload_before_last_phase": [1]}


def _checkpoint(root: Path, name: str, family: str, **overrides) -> Path:
    path = write_tiny_checkpoint(root / name, family, **overrides)
    write_tokenizer(path, vocab_size=json.loads((path / "config.json").read_text())["vocab_size"])
    return path


@pytest.fixture(scope="module")
def llama_with_adapters(tmp_path_factory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("tp")
    model = _checkpoint(root, "llama", "llama")
    return model, [write_peft_adapter(model, root / kind, kind) for kind in KINDS]


@pytest.mark.parametrize("fused", [False, True], ids=["two-allreduces", "fused-row-allreduce"])
def test_tp2_matches_one_device_for_base_and_adapters(llama_with_adapters, fused):
    model, adapters = llama_with_adapters
    spec = _spec(model, adapters)
    one = _drive(spec, enable_lora=True)
    two = _drive(spec, enable_lora=True, tensor_parallel_size=2, lora_fused_row_allreduce=fused)
    assert two["tokens"] == one["tokens"]
    # every adapter changed the output somewhere, so the comparison can see a missing adapter
    assert all(one["tokens"][f"alone{i}"] != one["tokens"]["alone0"] for i in range(1, len(adapters) + 1))
    assert two["lora"] == one["lora"]
    assert one["lora"]["loads"] > len(adapters)  # evictions forced slot rewrites on every rank


def test_tp2_with_one_kv_head_replicated(tmp_path):
    model = _checkpoint(tmp_path, "one-kv", "llama", num_key_value_heads=1)
    adapter = write_peft_adapter(model, tmp_path / "attention", "attention")
    spec = _spec(model, [adapter])
    assert _drive(spec, enable_lora=True, tensor_parallel_size=2)["tokens"] == _drive(spec, enable_lora=True)["tokens"]


def test_tp2_applies_a_logit_bias_to_its_row_only(llama_with_adapters):
    model, adapters = llama_with_adapters
    p = _prompts(3, seed=5)
    jobs = [["plain", p[0], 0], ["adapter", p[1], 1], ["biased", p[2], 0]]
    unbiased = _drive({"model": str(model), "adapters": [str(adapters[0])], "max_tokens": 6, "phases": [jobs]},
                      enable_lora=True)["tokens"]
    spec = {"model": str(model), "adapters": [str(adapters[0])], "max_tokens": 6, "phases": [jobs],
            "logit_bias": {"biased": {str(unbiased["biased"][0]): -100}}}
    one = _drive(spec, enable_lora=True)
    two = _drive(spec, enable_lora=True, tensor_parallel_size=2)
    assert two["tokens"] == one["tokens"]
    assert one["tokens"]["biased"][0] != unbiased["biased"][0]
    assert {k: one["tokens"][k] for k in ("plain", "adapter")} == {k: unbiased[k] for k in ("plain", "adapter")}
