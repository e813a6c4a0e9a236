"""Where the engine's time goes: torch.profiler's top operators of decode steps and of one long prefill.

    .venv/bin/python bench/step_profile.py --model .peer-model [--batch 32] [--prompt-len 1024] [--top 10]

In process, on the engine's own step loop: `batch` requests of 128 random prompt tokens decode greedily;
after `--warmup` steps, `--steps` decode-only steps are profiled. Then one `--prompt-len`-token prompt is
prefilled alone and profiled. Prints one JSON object: per phase the wall time per step and the top
operators by self CPU time (ms per step and share of the phase's profiled CPU time). The engine's
environment switches (LORAPLANE_LINEAR_WEIGHTS, LORAPLANE_NORM_KERNELS, ...) apply as in serving.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def top_ops(profile: Any, steps: int, top: int) -> list[dict[str, Any]]:
    """The `top` operators by self CPU time: name, calls and ms per step, share of the total."""
    events = [e for e in profile.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [{"op": e.key, "calls_per_step": round(e.count / steps, 1),
             "ms_per_step": round(e.self_cpu_time_total / 1000 / steps, 3),
             "share": round(e.self_cpu_time_total / total, 3)} for e in events[:top]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=20, help="decode steps before the profiled ones")
    parser.add_argument("--steps", type=int, default=20, help="decode steps profiled")
    parser.add_argument("--prompt-len", type=int, default=1024, help="the profiled prefill's prompt; 0: none")
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()

    import torch

    from data_plane.config import EngineConfig
    from data_plane.engine.llm_engine import LLMEngine
    from data_plane.engine.sampling_params import SamplingParams
    from data_plane.engine.sequence import Request

    max_len = max(1024, args.prompt_len + 16)
    engine = LLMEngine.from_config(EngineConfig(model=args.model, device="cpu", dtype=args.dtype,
                                                max_num_seqs=args.batch, max_model_len=max_len))
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.warmup + args.steps + 2, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(Request(f"d{i}", [rng.randrange(10, 4000) for _ in range(128)], params))
    for _ in range(args.warmup):
        engine.step()
    report: dict[str, Any] = {"benchmark": "step_profile", "model": args.model, "dtype": args.dtype,
                              "threads": torch.get_num_threads()}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        wall = time.perf_counter() - start
    report["decode"] = {"batch": args.batch, "steps": args.steps, "step_ms": round(1000 * wall / args.steps, 2),
                        "top": top_ops(profile, args.steps, args.top)}
    while engine.has_work():
        engine.step()
    if args.prompt_len:
        prompt = [rng.randrange(10, 4000) for _ in range(args.prompt_len)]
        engine.add_request(Request("p", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            start = time.perf_counter()
            steps = 0
            while engine.has_work():
                engine.step()
                steps += 1
            wall = time.perf_counter() - start
        report["prefill"] = {"prompt_len": args.prompt_len, "steps": steps, "ms": round(1000 * wall, 1),
                             "tokens_per_s": round(args.prompt_len / wall, 1), "top": top_ops(profile, 1, args.top)}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
