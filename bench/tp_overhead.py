"""Tensor-parallel communication on CPU: per-step time in collectives, TP=2 vs TP=1, both LoRA row modes.

    .venv/bin/python bench/tp_overhead.py [--requests 16] [--prompt-len 64] [--output-len 64]

Rank 0 (this process) times its own collectives (broadcast of each StepInput, all-reduces, the logits
all-gather). On a 2-core machine TP=2 cannot be faster than TP=1: two ranks share the same cores, so
these figures are for reference, not a speed-up claim. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from data_plane.adapters.loading.peft_loader import load_peft_adapter
from data_plane.config import EngineConfig
from data_plane.demo.adapters import DemoAdapter, write_lora_adapter
from data_plane.demo.model_builder import write_demo_model
from data_plane.distributed.comm_stats import COMM_STATS
from data_plane.engine.llm_engine import LLMEngine
from data_plane.engine.sampling_params import SamplingParams
from data_plane.engine.sequence import Request
from data_plane.lora.weights import TARGET_MODULES
from data_plane.model.config import ModelConfig


def measure(model_dir: Path, adapters: list, args: argparse.Namespace, **engine_flags) -> dict:
    engine = LLMEngine.from_config(EngineConfig(
        model=str(model_dir), device="cpu", enable_lora=True, max_loras=len(adapters), max_lora_rank=16, **engine_flags
    ))
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    step_times: list[float] = []
    try:
        for i in range(args.requests):
            w = adapters[i % len(adapters)]
            prompt = [rng.randrange(10, 4000) for _ in range(args.prompt_len)]
            engine.add_request(Request(f"r{i}", prompt, params, adapter_id=1 + i % len(adapters),
                                       prefix_hash_seed=w.cache_namespace, lora=w))
        engine.step()  # the prefill step: measured apart from decoding
        COMM_STATS.reset()
        while engine.has_work():
            start = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - start)
        steps = len(step_times)
        return {
            "decode_step_ms_median": round(statistics.median(step_times) * 1e3, 2),
            "comm_ms_per_step": round(COMM_STATS.seconds / steps * 1e3, 2),
            "comm_share": round(COMM_STATS.seconds / sum(step_times), 3),
            "collectives_per_step": round(COMM_STATS.calls / steps, 1),
        }
    finally:
        engine.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        write_demo_model(model_dir, seed=0)
        spec = DemoAdapter(r=16, lora_alpha=32, target_modules=TARGET_MODULES)
        config = ModelConfig.from_pretrained(model_dir)
        adapters = [
            load_peft_adapter(write_lora_adapter(model_dir, Path(tmp) / f"a{i}", spec, seed=i), config,
                              max_rank=16, allowed_roots=[tmp])
            for i in range(4)
        ]
        runs = {"tp1": {}, "tp2_two_allreduces": {"tensor_parallel_size": 2},
                "tp2_fused_row_allreduce": {"tensor_parallel_size": 2, "lora_fused_row_allreduce": True}}
        results = {name: measure(model_dir, adapters, args, **flags) for name, flags in tqdm(runs.items(), file=sys.stderr)}
    print(json.dumps({
        "benchmark": "tp_overhead", "device": "cpu (gloo), 2 cores shared by both ranks",
        "model": "demo: Qwen2 architecture, 4 layers, hidden 256", "lora": "4 adapters, rank 16, all 7 projections",
        "requests": args.requests, "prompt_len": args.prompt_len, "output_len": args.output_len, **results,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
