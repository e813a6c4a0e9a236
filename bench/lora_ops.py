"""The mixed-adapter LoRA ops alone: one step's LoRA work on every layer of a model shape through the
compiled CPU kernels and through the pure-torch ops (gather + bmm for decode tokens, one matmul per
prefill segment), alternated; medians of --repeats timings, with their range. Two steps: a decode step
of --tokens tokens, each of another adapter (cycling over --slots), and a prefill step of --slots
segments of --prefill-len tokens, one adapter each. Prints one JSON object.

A decode step of tokens of different adapters reads each of their slots' A and B once, two flops per
weight read: it is bound by how fast the host streams memory. So the decode figure comes with the bytes
it reads, the rate that makes, and, alternated with it, the same number of bytes summed by torch
(`stream_ms`, a plain read of one flat tensor on the same threads): `decode_vs_stream` is the
kernels' time over that, 1.0 for a kernel that reads as fast as the host can.

    .venv/bin/python bench/lora_ops.py [--shape 512,1408,6,8,2,384] [--tokens 32] [--slots 32] [--rank 16]
        [--prefill-len 64]
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
    parser.add_argument("--prefill-len", type=int, default=64, help="tokens of each prefill segment")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    if kernels is None:
        sys.exit("the CPU kernels did not build here")
    dtype, layers = getattr(torch, args.dtype), int(args.shape.split(",")[2])
    weights = []
    for dim, widths in layer_shapes(args.shape) * layers:
        a = torch.randn(args.slots, dim, len(widths) * args.rank, dtype=dtype)
        b = torch.randn(args.slots, args.rank, sum(widths), dtype=dtype)
        weights.append((dim, sum(widths), a, b, [(sum(widths[:i]), w) for i, w in enumerate(widths)]))
    cpu = torch.device("cpu")
    decode = [i % args.slots for i in range(args.tokens)]
    prefill = [s for s in range(args.slots) for _ in range(args.prefill_len)]
    steps = {"decode": (LoRABatch.build(decode, len(decode), args.rank, cpu), len(decode)),
             "prefill": (LoRABatch.build(prefill, 0, args.rank, cpu), len(prefill))}

    def step(backend, name: str) -> float:
        batch, tokens = steps[name]
        linears = activations[name]
        start = time.perf_counter()
        for (x, y), (_, _, a, b, lanes) in zip(linears, weights, strict=True):
            lora_shrink_expand(y, x, a, b, lanes, batch, backend)
        return time.perf_counter() - start

    used = min(args.tokens, args.slots)  # slots the decode step reads, each once
    decode_bytes = sum((a[:used].nbytes + b[:used].nbytes) for *_, a, b, _ in weights)
    stream = torch.randn(decode_bytes // dtype.itemsize, dtype=dtype)

    def stream_step() -> float:
        start = time.perf_counter()
        stream.sum()
        return time.perf_counter() - start

    activations = {name: [(torch.randn(tokens, dim, dtype=dtype), torch.zeros(tokens, out, dtype=dtype))
                          for dim, out, *_ in weights] for name, (_, tokens) in steps.items()}
    result = {"shape": args.shape, "tokens": args.tokens, "slots": args.slots, "rank": args.rank,
              "prefill_len": args.prefill_len, "dtype": args.dtype, "torch_threads": torch.get_num_threads()}
    for name, rounds in (("decode", 5), ("prefill", 1)):
        timings: dict[str, list[float]] = {"kernels": [], "torch": [], "stream": []}
        for _ in range(2):  # warm-up
            step(kernels, name), step(TORCH_KERNELS, name), stream_step()
        for _ in range(args.repeats):
            for _ in range(rounds):
                timings["kernels"].append(step(kernels, name))
                timings["torch"].append(step(TORCH_KERNELS, name))
                if name == "decode":
                    timings["stream"].append(stream_step())
        ms = {k: statistics.median(v) * 1e3 for k, v in timings.items() if v}
        result[name] = {
            "kernels_ms": round(ms["kernels"], 3), "torch_ms": round(ms["torch"], 3),
            "kernels_range_ms": [round(min(timings["kernels"]) * 1e3, 3), round(max(timings["kernels"]) * 1e3, 3)],
            "torch_range_ms": [round(min(timings["torch"]) * 1e3, 3), round(max(timings["torch"]) * 1e3, 3)],
            "speedup": round(ms["torch"] / ms["kernels"], 2),
        }
        if name == "decode":
            stream_ms = ms["stream"]
            result[name] |= {
                "weight_bytes": decode_bytes, "kernels_gb_s": round(decode_bytes / ms["kernels"] / 1e6, 1),
                "stream_ms": round(stream_ms, 3), "stream_gb_s": round(decode_bytes / stream_ms / 1e6, 1),
                "decode_vs_stream": round(ms["kernels"] / stream_ms, 2),
            }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
