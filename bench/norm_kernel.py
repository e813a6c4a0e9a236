"""A layer's residual add and RMSNorm alone: the compiled CPU kernel (data_plane/model/rms_norm_cpu.cpp)
against the torch ops it replaces (RMSNorm.add_forward with no kernel), alternated in one process, at a
decode batch's rows and a prefill chunk's; medians of --repeats timings (each the mean of --calls calls),
with their range, and the kernel's time over torch's. Prints one JSON object.

    .venv/bin/python bench/norm_kernel.py [--rows 32 2048] [--hidden 1024] [--dtype bfloat16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data_plane.model.layers.norm import RMSNorm  # noqa: E402
from data_plane.model.norm_kernels import load_cpu_norm  # noqa: E402


def timed_us(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor, calls: int) -> float:
    """Mean µs of one add + norm; each call adds into a fresh residual (the kernel writes it in place)."""
    residuals = [residual.clone() for _ in range(calls)]
    start = time.perf_counter()
    for r in residuals:
        norm.add_forward(x, r)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 2048])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    dtype = getattr(torch, args.dtype)
    kernel = load_cpu_norm()
    if kernel is None:
        sys.exit("the RMSNorm kernel did not build (see the warning above)")
    variants = {}
    for name, chosen in (("torch", None), ("kernel", kernel)):
        norm = RMSNorm(args.hidden).to(dtype)
        norm.kernel = chosen
        variants[name] = norm
    results = {}
    for rows in args.rows:
        x = torch.randn(rows, args.hidden).to(dtype)
        residual = torch.randn(rows, args.hidden).to(dtype)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for norm in variants.values():  # warm up
            timed_us(norm, x, residual, 10)
        for repeat in range(args.repeats):
            order = list(variants) if repeat % 2 == 0 else list(variants)[::-1]
            for name in order:
                times[name].append(timed_us(variants[name], x, residual, args.calls))
        results[str(rows)] = {
            **{f"{name}_us": {"median": round(statistics.median(t), 1), "min": round(min(t), 1),
                              "max": round(max(t), 1)} for name, t in times.items()},
            "kernel_over_torch": round(statistics.median(times["kernel"]) / statistics.median(times["torch"]), 3),
        }
    print(json.dumps({"benchmark": "norm_kernel", "hidden": args.hidden, "dtype": args.dtype,
                      "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                      "repeats": args.repeats, "calls": args.calls, "rows": results}))


if __name__ == "__main__":
    main()
