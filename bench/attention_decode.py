"""One layer's decode attention alone: the compiled CPU kernel (data_plane/model/paged_attention_cpu.cpp)
against the same kernel's source at another commit (--baseline-ref, built beside it under another op
namespace) and the torch path (gather + SDPA), alternated in one process, at each context length;
medians of --repeats timings (each the mean of --calls calls), with their range. Every sequence of the
batch has the same context, its blocks scattered over the cache. Prints one JSON object.

--once VARIANT runs a single call of one variant at the first context, on one thread, and prints
nothing: for an instruction count that load on the host does not change, e.g.

    valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*paged_decode_attention*' \\
        .venv/bin/python bench/attention_decode.py --once kernel --contexts 1024

    .venv/bin/python bench/attention_decode.py [--batch 32] [--heads 16] [--kv-heads 4] [--head-dim 64]
        [--contexts 128 256 512 1024] [--dtype bfloat16] [--baseline-ref main]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from data_plane.model.attention import DecodeAttentionKernel, PagedAttention
from data_plane.model.attention_kernels import SOURCE, load_cpu_decode_attention
from data_plane.model.attention_metadata import DecodeEntry, build_attention_metadata
from data_plane.model.cpu_extension import build_cpu_extension, build_dir

NAMESPACE = "loraplane_attention"
log = logging.getLogger("attention_decode")


def load_baseline(ref: str) -> DecodeAttentionKernel | None:
    """The kernel's source at git `ref`, its ops renamed into their own namespace, built beside the
    current one (None when git or the build fails)."""
    try:
        text = subprocess.run(["git", "show", f"{ref}:{SOURCE.relative_to(Path.cwd())}"], check=True,
                              capture_output=True, text=True).stdout
    except (subprocess.CalledProcessError, ValueError) as exc:
        log.warning("no baseline source at %s: %s", ref, exc)
        return None
    source = build_dir() / "bench_baseline" / "paged_attention_baseline.cpp"
    source.parent.mkdir(parents=True, exist_ok=True)
    renamed = text.replace(NAMESPACE, f"{NAMESPACE}_baseline")
    if not source.exists() or source.read_text() != renamed:
        source.write_text(renamed)  # rewritten only when changed, so ninja rebuilds only then
    if not build_cpu_extension("paged_attention_baseline", source, f"the kernel at {ref}", "no baseline", log):
        return None
    return torch.ops.loraplane_attention_baseline.paged_decode_attention


def commit(ref: str) -> str:
    """`ref`'s short commit id, and `+dirty` for HEAD with uncommitted changes to the kernel's source."""
    sha = subprocess.run(["git", "rev-parse", "--short", ref], capture_output=True, text=True).stdout.strip() or ref
    if ref == "HEAD" and subprocess.run(["git", "diff", "--quiet", "HEAD", "--", str(SOURCE)]).returncode:
        sha += "+dirty"
    return sha


def decode_step(batch: int, heads: int, kv_heads: int, dim: int, context: int, block_size: int,
                dtype: torch.dtype, seed: int):
    """A layer and its inputs for one decode step: q/k/v [B, H*D] / [B, Hkv*D], the cache, the metadata."""
    rng = random.Random(seed)
    per_seq = -(-context // block_size)
    order = rng.sample(range(batch * per_seq), batch * per_seq)
    entries = [DecodeEntry(order[b * per_seq:(b + 1) * per_seq], context) for b in range(batch)]
    cache = torch.randn(2, batch * per_seq * block_size, kv_heads, dim).to(dtype)
    q = torch.randn(batch, heads * dim).to(dtype)
    k, v = torch.randn(batch, kv_heads * dim).to(dtype), torch.randn(batch, kv_heads * dim).to(dtype)
    meta = build_attention_metadata(entries, [], block_size, torch.device("cpu"))
    return PagedAttention(heads, kv_heads, dim, dim**-0.5), (q, k, v, cache, meta)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--baseline-ref", default="main", help="git ref whose kernel source is the baseline")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20, help="calls per timing")
    parser.add_argument("--once", choices=["kernel", "baseline"], help="one call, on one thread, no output")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    kernel = load_cpu_decode_attention()
    if kernel is None:
        sys.exit("the CPU attention kernel did not build here")
    variants: dict[str, DecodeAttentionKernel | None] = {"kernel": kernel, "torch": None}
    if args.once in (None, "baseline"):
        baseline = load_baseline(args.baseline_ref)
        if baseline is not None:
            variants["baseline"] = baseline
        elif args.once == "baseline":
            sys.exit(f"the kernel at {args.baseline_ref} did not build")

    def runner(variant: str, context: int) -> Callable[[], object]:
        layer, (q, k, v, cache, meta) = decode_step(args.batch, args.heads, args.kv_heads, args.head_dim, context,
                                                   args.block_size, dtype, seed=context)
        layer.decode_kernel = variants[variant]
        return lambda: layer(q, k, v, cache, meta)

    if args.once:
        torch.set_num_threads(1)  # at::parallel_for runs inline: the whole call in the counted thread
        runner(args.once, args.contexts[0])()
        return 0

    results = {}
    for context in args.contexts:
        calls = {name: runner(name, context) for name in variants}
        for call in calls.values():
            call()  # warm: caches, first-call allocations
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, call in calls.items():  # alternated, so drift on the host hits every variant alike
                start = time.perf_counter()
                for _ in range(args.calls):
                    call()
                times[name].append((time.perf_counter() - start) / args.calls * 1e3)
        row: dict[str, object] = {f"{name}_ms": {"median": round(statistics.median(t), 4), "min": round(min(t), 4),
                                                 "max": round(max(t), 4)} for name, t in times.items()}
        for other in ("baseline", "torch"):
            if other in times:
                row[f"{other}_over_kernel"] = round(statistics.median(times[other]) / statistics.median(times["kernel"]), 2)
        results[str(context)] = row
    print(json.dumps({
        "shape": {"batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                  "block_size": args.block_size, "dtype": args.dtype},
        "baseline_ref": commit(args.baseline_ref) if "baseline" in variants else None, "kernel_ref": commit("HEAD"),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
        "repeats": args.repeats, "calls": args.calls, "contexts": results,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
