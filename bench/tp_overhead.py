"""Tensor-parallel communication on CPU: per-step time in collectives, TP=2 vs TP=1, both LoRA row modes.

    .venv/bin/python bench/tp_overhead.py [--requests 16] [--prompt-len 64] [--output-len 64]

Rank 0 (this process) times its own collectives (broadcast of each StepInput, all-reduces, the logits
all-gather): the torch.distributed calls that data_plane/distributed/collectives.py makes are wrapped here,
from outside the engine, for the bench's run only (`timed_collectives`). On a 2-core machine TP=2 cannot
be faster than TP=1: two ranks share the same cores, so these figures are for reference, not a speed-up
claim. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from tqdm import tqdm

from data_plane.adapters.loading.peft_loader import load_peft_adapter
from data_plane.config import EngineConfig
from data_plane.demo.adapters import DemoAdapter, write_lora_adapter
from data_plane.demo.model_builder import write_demo_model
from data_plane.engine.llm_engine import LLMEngine
from data_plane.engine.sampling_params import SamplingParams
from data_plane.engine.sequence import Request
from data_plane.lora.weights import TARGET_MODULES
from data_plane.model.config import ModelConfig

# the torch.distributed calls of data_plane/distributed/collectives.py
COLLECTIVES = ("all_reduce", "all_gather", "broadcast_object_list")


@dataclass
class CommStats:
    seconds: float = 0.0
    calls: int = 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


@contextmanager
def timed_collectives() -> Iterator[CommStats]:
    """While open, this process's calls of the COLLECTIVES are timed into the CommStats it yields. The engine
    calls them through the torch.distributed module (`dist.all_reduce(...)`), so replacing the module's
    attributes reaches every call; torch's own internal calls, and the other ranks' processes, are untouched."""
    stats = CommStats()

    def timed(fn: Callable[..., object]) -> Callable[..., object]:
        @functools.wraps(fn)
        def call(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                stats.seconds += time.perf_counter() - start
                stats.calls += 1
        return call

    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    for name, fn in originals.items():
        setattr(dist, name, timed(fn))
    try:
        yield stats
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


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
        with timed_collectives() as comm:
            engine.step()  # the prefill step: measured apart from decoding
            comm.reset()
            while engine.has_work():
                start = time.perf_counter()
                engine.step()
                step_times.append(time.perf_counter() - start)
        steps = len(step_times)
        return {
            "decode_step_ms_median": round(statistics.median(step_times) * 1e3, 2),
            "comm_ms_per_step": round(comm.seconds / steps * 1e3, 2),
            "comm_share": round(comm.seconds / sum(step_times), 3),
            "collectives_per_step": round(comm.calls / steps, 1),
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
