"""Multi-LoRA serving figures on the demo-size model (4 layers, hidden 256), or a generated one of
--shape, adapters of rank 16 on all seven projections. Every figure is a ratio of two runs in this
process. Prints one JSON object.

    .venv/bin/python bench/lora_throughput.py [--prompt-len 64] [--output-len 64] [--cycles 1000]
        [--shape 512,1408,6,8,2,384] [--figures a,b,c,d,e,f,g] [--kernels auto|torch]
        [--lora-dtype auto|bfloat16|float16]

--kernels torch runs the mixed-adapter ops in plain torch (LORAPLANE_LORA_KERNELS), for a before/after;
--lora-dtype stores the LoRA slots in that dtype (the engine's --lora-dtype; auto: the model's).

(e) serves 16 decoding requests three ways on one engine: steady (nothing else), with six short requests
of adapters already in slots arriving (their prefills, no file read, no slot write: the baseline of the
same arrivals), and with six adapters hot-loading (read on a low-priority thread, then the admitting step
writes each into a slot). `ratio` is hot-loading p99 / steady p99 (target <= 1.5); its
`load_ratio` = hot-loading p99 / arrivals p99 is what the loads themselves add to the steps beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from peft_baseline import NaivePeft  # bench/peft_baseline.py: run as `python bench/lora_throughput.py`
from tqdm import tqdm

from data_plane.adapters.loading.peft_loader import load_peft_adapter
from data_plane.background import lower_thread_priority
from data_plane.config import EngineConfig
from data_plane.demo.adapters import DemoAdapter, write_lora_adapter
from data_plane.demo.model_builder import DemoModelShape, write_demo_model
from data_plane.engine.llm_engine import LLMEngine
from data_plane.engine.sampling_params import SamplingParams
from data_plane.engine.sequence import Request
from data_plane.lora.weights import TARGET_MODULES, LoRAAdapterWeights
from data_plane.model.config import ModelConfig

RANK = 16
Job = tuple[list[int], int, LoRAAdapterWeights | None]  # prompt, adapter id, weights


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args = args
        self.model_dir = root / "model"
        if args.shape:
            hidden, intermediate, layers, heads, kv_heads, vocab = (int(x) for x in args.shape.split(","))
            write_demo_model(self.model_dir, seed=0, shape=DemoModelShape(layers, hidden, heads, kv_heads, intermediate),
                             vocab_size=vocab)
        else:
            write_demo_model(self.model_dir, seed=0)
        spec = DemoAdapter(r=RANK, lora_alpha=2 * RANK, target_modules=TARGET_MODULES)
        self.adapter_dirs = [write_lora_adapter(self.model_dir, root / f"a{i}", spec, seed=i) for i in range(32)]
        self.model_config = ModelConfig.from_pretrained(self.model_dir)
        self.vocab = min(4000, self.model_config.vocab_size)
        self.weights = [self.read_adapter(d) for d in self.adapter_dirs]
        self.rng = random.Random(0)

    def read_adapter(self, path: Path) -> LoRAAdapterWeights:
        return load_peft_adapter(path, self.model_config, max_rank=RANK, allowed_roots=[str(path.parent)])

    def engine(self, **overrides) -> LLMEngine:
        if overrides.get("enable_lora"):
            overrides.setdefault("lora_dtype", self.args.lora_dtype)
        return LLMEngine.from_config(EngineConfig(model=str(self.model_dir), device="cpu", max_num_seqs=64, **overrides))

    def prompts(self, n: int) -> list[list[int]]:
        return [[self.rng.randrange(10, self.vocab) for _ in range(self.args.prompt_len)] for _ in range(n)]

    def jobs(self, n: int, num_adapters: int) -> list[Job]:
        """n requests spread round-robin over the first num_adapters adapters (0 = base only)."""
        return [
            (p, 1 + i % num_adapters, self.weights[i % num_adapters]) if num_adapters else (p, 0, None)
            for i, p in enumerate(self.prompts(n))
        ]

    def run(self, engine: LLMEngine, jobs: list[Job], arrive_every: int = 0, on_step=None) -> dict:
        """Serve jobs to completion; returns seconds, output tokens, TTFTs and per-step intervals (one step's
        end to the next's: the inter-token latency of a running decode)."""
        params = SamplingParams(temperature=0.0, max_tokens=self.args.output_len, ignore_eos=True)
        arrival: dict[str, float] = {}
        ttft: dict[str, float] = {}
        step_times: list[float] = []
        tokens = 0
        pending = list(enumerate(jobs))
        start = time.perf_counter()
        last_end = start
        steps = 0
        while pending or engine.has_work():
            while pending and steps >= pending[0][0] * arrive_every:
                i, (prompt, adapter_id, w) = pending.pop(0)
                rid = f"r{i}-{time.perf_counter_ns()}"
                engine.add_request(Request(rid, prompt, params, adapter_id=adapter_id,
                                           prefix_hash_seed=w.cache_namespace if w else 0, lora=w))
                arrival[rid] = time.perf_counter()
            if on_step is not None:
                on_step(engine, steps)
            outputs = engine.step()
            # from the previous step's end: what a server's loop does between steps (add_request, which
            # makes a new adapter's slot image) delays the next token as much as the step itself
            step_end = time.perf_counter()
            step_times.append(step_end - last_end)
            last_end = step_end
            for out in outputs:
                new = sum(len(d.token_ids) for d in out.deltas)
                tokens += new
                if new and out.request_id not in ttft and out.request_id in arrival:
                    ttft[out.request_id] = time.perf_counter() - arrival[out.request_id]
            steps += 1
        return {"seconds": time.perf_counter() - start, "tokens": tokens, "ttft": list(ttft.values()), "steps": step_times}

    def tokens_per_s(self, engine: LLMEngine, jobs: list[Job]) -> float:
        result = self.run(engine, jobs)
        return result["tokens"] / result["seconds"]


def median_ratio(bench: Bench, numerator, denominator, repeats: int) -> tuple[float, float, float]:
    """Alternate the two measurements `repeats` times; medians of each and their ratio."""
    nums, dens = [], []
    for _ in range(repeats):
        nums.append(numerator())
        dens.append(denominator())
    num, den = statistics.median(nums), statistics.median(dens)
    return round(num, 1), round(den, 1), round(num / den, 3)


def naive_peft_tokens_per_s(bench: Bench, jobs: list[Job]) -> float:
    """The usual way without a LoRA server: transformers + PEFT, one adapter (and request) at a time."""
    peft = NaivePeft(bench.model_dir, bench.adapter_dirs)
    return peft.tokens_per_s([(prompt, adapter_id - 1) for prompt, adapter_id, _ in jobs], bench.args.output_len)


def _run_with_arrivals(bench: Bench, engine: LLMEngine, decoding: list[Job], adapters: list[int],
                       read: bool, prepare: bool) -> tuple[list[float], list[int]]:
    """Serve `decoding` while six short requests of `adapters` (ids) arrive from another thread, 50 ms
    apart; step times, submit steps. read: that thread reads each adapter's files first (a hot load: the
    admitting step then writes it into a slot); else it hands over weights read before, of adapters
    already resident (the same arrivals and prefills, no read, no slot write). prepare: the thread also
    makes each slot image (LoRASlotManager.prepare), as an engine that prepares adapters when they
    arrive would; without it add_request does (between steps)."""
    ready: list[Job] = []
    submitted: list[int] = []

    def arrive() -> None:
        lower_thread_priority()  # as the registry's reader threads do
        for adapter_id in adapters:
            weights = bench.read_adapter(bench.adapter_dirs[adapter_id - 1]) if read else bench.weights[adapter_id - 1]
            if prepare:
                engine.lora_slots.prepare(weights)
            ready.append(([11, 12, 13, 14], adapter_id, weights))
            time.sleep(0.05)

    thread = threading.Thread(target=arrive, daemon=True)

    def submit_ready(engine: LLMEngine, step: int) -> None:
        if step == 3:
            thread.start()
        while ready:
            prompt, adapter_id, w = ready.pop(0)
            engine.add_request(Request(f"hot{adapter_id}-{step}-{time.perf_counter_ns()}", prompt,
                                       SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                                       adapter_id=adapter_id, prefix_hash_seed=w.cache_namespace, lora=w))
            submitted.append(step)

    steps = bench.run(engine, decoding, on_step=submit_ready)["steps"]
    thread.join()  # (a short run may end before it: its adapters then load in no step)
    return steps, submitted


def hot_load_itl(bench: Bench, repeats: int, prepare: bool) -> dict:
    """p99 step time (= inter-token latency) of 16 decoding requests: steady, with six arrivals of
    resident adapters, and while six adapters hot-load (module docstring). Medians over `repeats`
    alternating runs. slot_write_ms: the engine's own timing of its slot writes (last_load_seconds)."""
    p99 = lambda xs: statistics.quantiles(xs, n=100)[98]  # noqa: E731
    runs: dict[str, list[float]] = {"steady": [], "arrivals": [], "hot": []}
    steady_median, load_steps, arrival_steps, writes = [], [], [], []
    for _ in range(repeats):
        engine = bench.engine(enable_lora=True, max_loras=4, max_lora_rank=RANK)
        decoding = [(p, 1 + i % 2, bench.weights[i % 2]) for i, p in enumerate(bench.prompts(16))]
        steady = bench.run(engine, decoding)["steps"][2:]
        for adapter_id in (1, 2):  # the streams' adapters keep their slots (0 and 1) even where a slow read
            engine.pin_lora(adapter_id, bench.weights[adapter_id - 1])  # lets the decodes end first
        hot, submitted = _run_with_arrivals(bench, engine, decoding, list(range(3, 9)), read=True, prepare=prepare)
        load_steps.extend(hot[step] for step in submitted)  # the step that copied the adapter in
        writes.extend(a.last_load_seconds for i, a in engine.stats().lora.adapters.items() if i > 2 and a.loads)
        for adapter_id in (7, 8):  # resident (slots 2 and 3) for the arrivals' baseline
            engine.pin_lora(adapter_id, bench.weights[adapter_id - 1])
            engine.unpin_lora(adapter_id)
        loads = sum(a.loads for a in engine.stats().lora.adapters.values())
        arrivals, submitted = _run_with_arrivals(bench, engine, decoding, [7, 8] * 3, read=False, prepare=False)
        after = {i: a.loads for i, a in engine.stats().lora.adapters.items()}
        assert sum(after.values()) == loads, f"the baseline loaded a slot: loads by adapter {after}, {loads} before"
        arrival_steps.extend(arrivals[step] for step in submitted)
        runs["steady"].append(p99(steady))
        runs["arrivals"].append(p99(arrivals[2:]))
        runs["hot"].append(p99(hot[2:]))
        steady_median.append(statistics.median(steady))
    p = {k: statistics.median(v) for k, v in runs.items()}
    return {"steady_p99_ms": round(p["steady"] * 1e3, 2), "arrivals_p99_ms": round(p["arrivals"] * 1e3, 2),
            "hot_load_p99_ms": round(p["hot"] * 1e3, 2),
            "ratio": round(p["hot"] / p["steady"], 3), "load_ratio": round(p["hot"] / p["arrivals"], 3),
            "steady_median_step_ms": round(statistics.median(steady_median) * 1e3, 2),
            "mean_step_with_a_slot_load_ms": round(statistics.fmean(load_steps) * 1e3, 2),
            "mean_step_with_an_arrival_ms": round(statistics.fmean(arrival_steps) * 1e3, 2),
            "mean_slot_write_ms": round(statistics.fmean(writes) * 1e3, 3) if writes else None,
            "slot_loads": len(load_steps)}


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def load_unload_cycles(bench: Bench, cycles: int) -> dict:
    engine = bench.engine(enable_lora=True, max_loras=4, max_lora_rank=RANK)
    warmup = max(10, cycles // 10)
    rss = 0
    for i in tqdm(range(cycles + warmup), desc="load/unload cycles", file=sys.stderr):
        if i == warmup:
            rss = rss_bytes()
        weights = bench.read_adapter(bench.adapter_dirs[i % len(bench.adapter_dirs)])
        engine.pin_lora(100 + i, weights)
        engine.remove_lora(100 + i)
    growth = rss_bytes() - rss
    return {"cycles": cycles, "rss_before_mb": round(rss / 2**20, 1), "rss_growth_pct": round(100 * growth / rss, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--shape", help="hidden,intermediate,layers,heads,kv_heads,vocab (default: the demo model)")
    parser.add_argument("--figures", default="a,b,c,d,e,f,g", help="which figures, comma-separated")
    parser.add_argument("--kernels", choices=["auto", "torch"], default="auto",
                        help="the mixed-adapter LoRA ops: compiled kernels (auto) or plain torch")
    parser.add_argument("--lora-dtype", choices=["auto", "bfloat16", "float16"], default="auto",
                        help="the LoRA slots' dtype (the engine's --lora-dtype)")
    args = parser.parse_args()
    os.environ["LORAPLANE_LORA_KERNELS"] = args.kernels  # read when the engines' LoRA layers are built
    wanted = set(args.figures.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(args, Path(tmp))
        plain = bench.engine()
        lora = bench.engine(enable_lora=True, max_loras=32, max_lora_rank=RANK)
        steps = tqdm(total=len(wanted), desc="lora benchmark", file=sys.stderr)
        bench.run(lora, bench.jobs(4, 4))  # warm-up, and every adapter of (b)/(c) resident from here on
        bench.run(lora, bench.jobs(32, 32))
        model = f"generated Qwen2 shape {args.shape}" if args.shape else "demo: Qwen2 architecture, 4 layers, hidden 256, GQA 8/2, vocab 4096"
        figures: dict = {"model": model, "adapter_rank": RANK, "adapter_targets": list(TARGET_MODULES),
                         "prompt_len": args.prompt_len, "output_len": args.output_len, "device": "cpu",
                         "torch_threads": torch.get_num_threads(), "kernels": type(lora.lora_slots.layers[0][0].kernels).__name__,
                         "lora_dtype": str(lora.lora_slots.pool.pool.dtype).removeprefix("torch.")}
        if "a" in wanted:
            a = median_ratio(bench, lambda: bench.tokens_per_s(lora, bench.jobs(32, 0)),
                             lambda: bench.tokens_per_s(plain, bench.jobs(32, 0)), args.repeats)
            figures["a_base_traffic_lora_enabled_vs_disabled"] = {"enabled_tok_s": a[0], "disabled_tok_s": a[1], "ratio": a[2], "target": ">= 0.97"}
            steps.update()
        b = None
        if wanted & {"b", "d"}:
            b = median_ratio(bench, lambda: bench.tokens_per_s(lora, bench.jobs(32, 32)),
                             lambda: bench.tokens_per_s(lora, bench.jobs(32, 0)), args.repeats)
            figures["b_32_adapters_vs_base"] = {"adapters_tok_s": b[0], "base_tok_s": b[1], "ratio": b[2], "target": ">= 0.85"}
            steps.update()
        if "c" in wanted:
            c = median_ratio(bench, lambda: bench.tokens_per_s(lora, bench.jobs(32, 4)),
                             lambda: bench.tokens_per_s(lora, bench.jobs(32, 32)), args.repeats)
            figures["c_4_vs_32_adapters"] = {"4_adapters_tok_s": c[0], "32_adapters_tok_s": c[1], "ratio": c[2], "target": "within 10%"}
            steps.update()
        if "d" in wanted:
            naive = naive_peft_tokens_per_s(bench, bench.jobs(32, 32))
            figures["d_engine_vs_naive_peft"] = {"engine_tok_s": b[0], "naive_tok_s": round(naive, 1),
                                                 "ratio": round(b[0] / naive, 2), "target": ">= 10"}
            steps.update()
        if "e" in wanted:
            figures["e_itl_while_hot_loading"] = hot_load_itl(bench, args.repeats, prepare=False) | {"target": "ratio <= 1.5"}
            figures["e_prepared_on_the_reader_thread"] = hot_load_itl(bench, args.repeats, prepare=True) | {"target": "ratio <= 1.5"}
            steps.update()
        if "f" in wanted:
            ttft = {}
            for slots in (8, 4):
                # requests one after another, cycling over 8 adapters: with 4 slots every one of them
                # evicts an adapter and copies its own into the slot before its prefill
                engine = bench.engine(enable_lora=True, max_loras=slots, max_lora_rank=RANK)
                bench.run(engine, bench.jobs(8, 8))  # warm: 8 adapters seen once
                ttft[slots] = statistics.median(t for job in bench.jobs(32, 8) for t in bench.run(engine, [job])["ttft"])
            figures["f_working_set_twice_the_slots_median_ttft"] = {
                "all_resident_ms": round(ttft[8] * 1e3, 1), "twice_the_slots_ms": round(ttft[4] * 1e3, 1),
                "ratio": round(ttft[4] / ttft[8], 3), "target": "<= 3"}
            steps.update()
        if "g" in wanted:
            figures["g_load_unload_cycles"] = load_unload_cycles(bench, args.cycles) | {"target": "rss_growth_pct < 2"}
            steps.update()
        steps.close()
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
