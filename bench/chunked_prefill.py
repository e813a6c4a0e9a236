"""Inter-token latency of running decodes while 2,048-token prompts arrive, with and without chunked prefill.

    .venv/bin/python bench/chunked_prefill.py [--model DIR | --shape 512,1408,6,8,2,384] [--decodes 32]
        [--long-prompt-len 2048] [--long-prompts 3] [--budgets 2048] [--stall-limits 1.25 0] [--repeats 3]

In one process, one engine per configuration: `--decodes` requests decode all along; in the measured
window `--long-prompts` prompts of `--long-prompt-len` tokens arrive one after another (the next when
the previous has its first token). An inter-token latency is the time between two tokens of one of the
running decodes. Each repeat runs, in turn, the decodes alone (the baseline), the arrivals with chunked
prefill at each `--budgets` token budget, and the arrivals without chunking (each long prompt in one
step, the stall chunking removes); the baseline counts the same number of steps as the first chunked
run. Reported: per configuration the median and range over repeats of the p50/p99 ITL, of the p99's
ratio to the same repeat's baseline (target <= 1.5) and of the long prompts' time to first token. Chunked
configurations are `chunked_<budget>_stall_<limit>`: the token budget (--max-num-batched-tokens) and
the engine's --decode-stall-limit (0: no pacing, chunks fill the budget as in vLLM); the defaults are
the engine's own (2048, 1.25) next to vLLM's behaviour.
Prints one JSON object.
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

import torch

from data_plane.config import EngineConfig
from data_plane.demo.model_builder import DemoModelShape, write_demo_model
from data_plane.engine.llm_engine import LLMEngine
from data_plane.engine.prefill_pacer import MIN_LONG_CHUNK
from data_plane.engine.sampling_params import SamplingParams
from data_plane.engine.sequence import Request

# the demo config's 2048 positions cannot hold a 2,048-token prompt and its output; rope has no limit
MAX_POSITIONS = 4096


def build_model(shape: str, root: Path) -> Path:
    hidden, intermediate, layers, heads, kv_heads, vocab = (int(x) for x in shape.split(","))
    path = root / "model"
    write_demo_model(path, seed=0, shape=DemoModelShape(layers, hidden, heads, kv_heads, intermediate), vocab_size=vocab)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = MAX_POSITIONS
    (path / "config.json").write_text(json.dumps(config))
    return path


def run_window(engine: LLMEngine, args, rng: random.Random, arrivals: bool, steps: int | None) -> dict:
    """Decodes running; with `arrivals`, long prompts arrive one at a time until each has its first token,
    else `steps` steps of the decodes alone. Returns the decodes' ITLs (s), long TTFTs (s), step count."""
    vocab = engine.vocab_size
    decode = SamplingParams(temperature=0.0, max_tokens=args.decode_output_len, ignore_eos=True)
    for i in range(args.decodes):
        engine.add_request(Request(f"d{i}", [rng.randrange(10, vocab) for _ in range(args.decode_prompt_len)], decode))
    while len(engine.scheduler.running) < args.decodes or engine.scheduler.waiting:
        engine.step()  # every decode admitted and past its prompt
    engine.step()
    last: dict[str, float] = {}
    itls: list[float] = []
    ttfts: list[float] = []
    long_params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    sent = 0
    arrived = 0.0
    waiting_first = False
    window_steps = 0
    while True:
        if arrivals and not waiting_first:
            if sent == args.long_prompts:
                break
            prompt = [rng.randrange(10, vocab) for _ in range(args.long_prompt_len)]
            engine.add_request(Request(f"long{sent}", prompt, long_params))
            sent, arrived, waiting_first = sent + 1, time.perf_counter(), True
        if not arrivals and window_steps == steps:
            break
        outputs = engine.step()
        now = time.perf_counter()
        window_steps += 1
        for out in outputs:
            if out.request_id.startswith("long"):
                if waiting_first and out.request_id == f"long{sent - 1}":
                    ttfts.append(now - arrived)
                    waiting_first = False
                continue
            if out.request_id in last:
                itls.append(now - last[out.request_id])
            last[out.request_id] = now
        if window_steps > 20_000:
            raise RuntimeError("the window never ended")
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    return {"itls": itls, "ttfts": ttfts, "steps": window_steps}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median_range(values: list[float], digits: int = 2) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--shape", default="512,1408,6,8,2,384", help="hidden,intermediate,layers,heads,kv_heads,vocab")
    parser.add_argument("--decodes", type=int, default=32)
    parser.add_argument("--decode-prompt-len", type=int, default=32)
    parser.add_argument("--long-prompt-len", type=int, default=2048)
    parser.add_argument("--long-prompts", type=int, default=3)
    parser.add_argument("--budgets", type=int, nargs="+", default=[2048], help="chunked --max-num-batched-tokens")
    parser.add_argument("--stall-limits", type=float, nargs="+", default=[1.25, 0.0], help="chunked --decode-stall-limit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    tmp = tempfile.TemporaryDirectory()
    model = args.model or build_model(args.shape, Path(tmp.name))
    max_len = args.long_prompt_len + 64
    # the decodes outlive the slowest window: every long prompt chunked at the smallest budget
    chunk = max(1, min(args.budgets) - args.decodes - 1)
    if any(args.stall_limits):
        chunk = min(chunk, MIN_LONG_CHUNK)  # the pacer's smallest share
    args.decode_output_len = args.long_prompts * (args.long_prompt_len // chunk + 4) + 16
    max_len = max(max_len, args.decode_prompt_len + args.decode_output_len)
    common = dict(model=str(model), device="cpu", max_num_seqs=args.decodes + 1, max_model_len=max_len,
                  kv_cache_memory_mb=1024)
    engines = {f"chunked_{b}_stall_{limit:g}": LLMEngine.from_config(
                   EngineConfig(**common, max_num_batched_tokens=b, decode_stall_limit=limit))
               for b in args.budgets for limit in args.stall_limits}
    engines["unchunked"] = LLMEngine.from_config(EngineConfig(**common, enable_chunked_prefill=False))
    first = next(iter(engines))

    per: dict[str, dict[str, list[float]]] = {}
    for repeat in range(args.repeats):
        rng = random.Random(args.seed + repeat)
        runs = {name: run_window(engine, args, rng, arrivals=True, steps=None) for name, engine in engines.items()}
        baseline = run_window(engines[first], args, rng, arrivals=False, steps=runs[first]["steps"])
        base_p99 = percentile(baseline["itls"], 0.99)
        for name, result in [("baseline", baseline), *runs.items()]:
            row = per.setdefault(name, {"p50_ms": [], "p99_ms": [], "p99_over_baseline": [], "long_ttft_s": []})
            p99 = percentile(result["itls"], 0.99)
            row["p50_ms"].append(1e3 * percentile(result["itls"], 0.5))
            row["p99_ms"].append(1e3 * p99)
            row["p99_over_baseline"].append(p99 / base_p99)
            if result["ttfts"]:
                row["long_ttft_s"].append(statistics.median(result["ttfts"]))
        print(f"repeat {repeat}: " + ", ".join(f"{n} p99 {per[n]['p99_ms'][-1]:.1f} ms" for n in per), file=sys.stderr)

    results = {}
    for name, row in per.items():
        results[name] = {key: median_range(values, 3 if key == "p99_over_baseline" else 2)
                         for key, values in row.items() if values}
    print(json.dumps({
        "benchmark": "chunked_prefill",
        "model": str(args.model) if args.model else f"demo shape {args.shape}",
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "decodes": args.decodes,
        "long_prompt_len": args.long_prompt_len,
        "long_prompts_per_window": args.long_prompts,
        "repeats": args.repeats,
        "target": "chunked p99 ITL <= 1.5x baseline",
        "results": results,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
