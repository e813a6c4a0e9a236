"""Engine vs transformers `generate` on the same batch, in the same process: output tokens/s and ratio.

    .venv/bin/python bench/throughput.py [--model DIR | --shape 512,1408,6,8,2,384] [--batch-sizes 16 32]
        [--prompt-len 128] [--output-len 128]

Without --model a demo model is generated in a temporary directory: the demo shape, or --shape
(hidden,intermediate,layers,heads,kv_heads,vocab; the other benches' default is 512,1408,6,8,2,384).
LORAPLANE_ATTENTION_KERNELS=torch runs the engine's decode attention on the torch path (gather + SDPA)
instead of the CPU kernel, for a before/after. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from data_plane.config import EngineConfig
from data_plane.demo.model_builder import DemoModelShape, write_demo_model
from data_plane.engine.llm_engine import LLMEngine
from data_plane.engine.sampling_params import SamplingParams
from data_plane.engine.sequence import Request
from data_plane.model.attention_kernels import ATTENTION_KERNELS_ENV


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(batch)]


def run_engine(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"b{i}", prompt, params))
        tokens[f"b{i}"] = []
    while engine.has_work():
        for output in engine.step():
            for delta in output.deltas:
                tokens[output.request_id].extend(delta.token_ids)
    return time.perf_counter() - start, [tokens[f"b{i}"] for i in range(len(prompts))]


def run_transformers(model, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                             do_sample=False, pad_token_id=0)
    return time.perf_counter() - start, out[:, ids.shape[1]:].tolist()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--shape", help="hidden,intermediate,layers,heads,kv_heads,vocab of the generated model")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each side; medians are reported")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM  # benchmark-only oracle

    tmp = None
    if args.model is None:
        tmp = tempfile.TemporaryDirectory()
        args.model = Path(tmp.name) / "demo"
        if args.shape:
            hidden, intermediate, layers, heads, kv_heads, vocab = (int(x) for x in args.shape.split(","))
            shape = DemoModelShape(layers, hidden, heads, kv_heads, intermediate)
            write_demo_model(args.model, seed=args.seed, shape=shape, vocab_size=vocab)
        else:
            write_demo_model(args.model, seed=args.seed)
    engine = LLMEngine.from_config(EngineConfig(model=str(args.model), device="cpu", max_num_seqs=max(args.batch_sizes)))
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # both sides generate exactly output_len tokens
    vocab = engine.vocab_size

    # warm-up both paths once (allocator, thread pools)
    warm = _prompts(2, 16, vocab, seed=99)
    run_engine(engine, warm, 4)
    run_transformers(hf, warm, 4)

    results = []
    runs = [(b, r) for b in args.batch_sizes for r in range(args.repeats)]
    timings: dict[int, dict[str, list[float]]] = {b: {"engine": [], "hf": []} for b in args.batch_sizes}
    identical: dict[int, int] = {}
    # engine and transformers alternate on the same prompts, so machine noise hits both sides alike
    for batch, repeat in tqdm(runs, desc="benchmark runs", file=sys.stderr):
        # fresh prompts each repeat, so the engine's prefix cache never serves a repeated prompt
        prompts = _prompts(batch, args.prompt_len, vocab, seed=args.seed + 1000 * repeat + batch)
        engine_s, engine_tokens = run_engine(engine, prompts, args.output_len)
        hf_s, hf_tokens = run_transformers(hf, prompts, args.output_len)
        timings[batch]["engine"].append(engine_s)
        timings[batch]["hf"].append(hf_s)
        identical[batch] = sum(a == b for a, b in zip(engine_tokens, hf_tokens, strict=True))
    for batch in args.batch_sizes:
        engine_s = statistics.median(timings[batch]["engine"])
        hf_s = statistics.median(timings[batch]["hf"])
        generated = batch * args.output_len
        results.append({
            "batch": batch,
            "engine_tokens_per_s": round(generated / engine_s, 1),
            "transformers_tokens_per_s": round(generated / hf_s, 1),
            "ratio_engine_over_transformers": round(hf_s / engine_s, 3),
            "greedy_sequences_identical": identical[batch],
        })
    print(json.dumps({
        "benchmark": "throughput",
        "model": str(args.model) if tmp is None else f"demo (generated{', shape ' + args.shape if args.shape else ''})",
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "decode_attention": os.environ.get(ATTENTION_KERNELS_ENV, "auto"),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "results": results,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
