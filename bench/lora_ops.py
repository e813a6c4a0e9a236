"""The mixed-adapter LoRA ops alone: one decode step's LoRA work on every layer of a model shape, each
token of another adapter, through the compiled CPU kernels and through the pure-torch ops (gather +
bmm), alternated; medians of --repeats timings, with their range. Prints one JSON object.

    .venv/bin/python bench/lora_ops.py [--shape 512,1408,6,8,2,384] [--tokens 32] [--slots 32] [--rank 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from data_plane.lora.kernels.cpu import load_cpu_kernels
from data_plane.lora.ops import TORCH_KERNELS, lora_shrink_expand
from data_plane.model.lora_batch import LoRABatch


def layer_shapes(shape: str) -> list[tuple[int, list[int]]]:
    """(in, lane widths) of the four LoRA linears of one decoder layer: qkv, o, gate_up, down."""
    hidden, intermediate, _, heads, kv_heads, _ = (int(x) for x in shape.split(","))
    kv = hidden // heads * kv_heads
    return [(hidden, [hidden, kv, kv]), (hidden, [hidden]), (hidden, [intermediate, intermediate]), (intermediate, [hidden])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="512,1408,6,8,2,384", help="hidden,intermediate,layers,heads,kv_heads,vocab")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    if kernels is None:
        sys.exit("the CPU kernels did not build here")
    dtype, layers = getattr(torch, args.dtype), int(args.shape.split(",")[2])
    linears = []
    for dim, widths in layer_shapes(args.shape) * layers:
        a = torch.randn(args.slots, dim, len(widths) * args.rank, dtype=dtype)
        b = torch.randn(args.slots, args.rank, sum(widths), dtype=dtype)
        lanes = [(sum(widths[:i]), w) for i, w in enumerate(widths)]
        linears.append((torch.randn(args.tokens, dim, dtype=dtype), torch.zeros(args.tokens, sum(widths), dtype=dtype), a, b, lanes))
    batch = LoRABatch.build([i % args.slots for i in range(args.tokens)], args.tokens, args.rank, torch.device("cpu"))

    def step(backend) -> float:
        start = time.perf_counter()
        for x, y, a, b, lanes in linears:
            lora_shrink_expand(y, x, a, b, lanes, batch, backend)
        return time.perf_counter() - start

    timings: dict[str, list[float]] = {"kernels": [], "torch": []}
    for _ in range(3):  # warm-up
        step(kernels), step(TORCH_KERNELS)
    for _ in range(args.repeats):
        for _ in range(5):
            timings["kernels"].append(step(kernels))
            timings["torch"].append(step(TORCH_KERNELS))
    ms = {k: statistics.median(v) * 1e3 for k, v in timings.items()}
    print(json.dumps({
        "shape": args.shape, "tokens": args.tokens, "slots": args.slots, "rank": args.rank, "dtype": args.dtype,
        "torch_threads": torch.get_num_threads(),
        "kernels_ms_per_step": round(ms["kernels"], 3), "torch_ms_per_step": round(ms["torch"], 3),
        "kernels_range_ms": [round(min(timings["kernels"]) * 1e3, 3), round(max(timings["kernels"]) * 1e3, 3)],
        "torch_range_ms": [round(min(timings["torch"]) * 1e3, 3), round(max(timings["torch"]) * 1e3, 3)],
        "speedup": round(ms["torch"] / ms["kernels"], 2),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
