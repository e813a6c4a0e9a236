"""The engine's decode step at one batch size, in process, for each weight layout, alternated.

    .venv/bin/python bench/decode_step.py --model .peer-model [--batch 32] [--repeats 3] [--layouts auto plain]

Each run is a fresh process (LORAPLANE_LINEAR_WEIGHTS=<layout>, data_plane/model/layers/cpu_weights.py):
`batch` requests of 128 random prompt tokens and 64 greedy tokens out, the median wall time of the last
50 steps (decode only, all `batch` sequences running). Prints one JSON object: per layout the median over
the repeats and the range.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(model: str, batch: int, dtype: str) -> float:
    from data_plane.config import EngineConfig
    from data_plane.engine.llm_engine import LLMEngine
    from data_plane.engine.sampling_params import SamplingParams
    from data_plane.engine.sequence import Request

    engine = LLMEngine.from_config(EngineConfig(model=model, device="cpu", dtype=dtype, max_num_seqs=batch,
                                                max_model_len=1024))
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i in range(batch):
        engine.add_request(Request(f"r{i}", [rng.randrange(10, 4000) for _ in range(128)], params))
    steps = []
    while engine.has_work():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return 1000 * statistics.median(steps[-50:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", default=["auto", "plain"], choices=["auto", "plain"])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(child(args.model, args.batch, args.dtype))
        return 0
    times: dict[str, list[float]] = {layout: [] for layout in args.layouts}
    for repeat in range(args.repeats):
        for layout in args.layouts:
            env = {**os.environ, "LORAPLANE_LINEAR_WEIGHTS": layout, "PYTHONPATH": str(REPO)}
            out = subprocess.run([sys.executable, __file__, "--child", "--model", args.model, "--batch", str(args.batch),
                                  "--dtype", args.dtype], env=env, capture_output=True, text=True, check=True)
            times[layout].append(float(out.stdout.strip().splitlines()[-1]))
            print(f"repeat {repeat + 1}/{args.repeats} {layout}: {times[layout][-1]:.1f} ms", file=sys.stderr)
    print(json.dumps({"benchmark": "decode_step", "model": args.model, "batch": args.batch, "dtype": args.dtype,
                      "repeats": args.repeats, "decode_step_ms": {
                          layout: {"median": round(statistics.median(v), 1), "min": round(min(v), 1),
                                   "max": round(max(v), 1)} for layout, v in times.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
