"""Serving over HTTP vs the engine in process, on the same model in the same run: tokens/s, TTFT, ITL.

    .venv/bin/python bench/serving.py [--model DIR | --shape 512,1408,6,8,2,384] [--clients 1 8 32]
        [--torch-threads 1 2] [--servers core thread] [--adapters N --rank R [--peft]] [--repeats 3] [--quick]

Starts real `loraplane engine` processes (`core`: the engine-core process, the default; `thread`: the
engine on a thread of the API process, --no-engine-core-process), one per torch thread count, and
drives them over HTTP (/v1/completions, token-id prompts, greedy, ignore_eos) from a separate client
process with 1, 8 and 32 concurrent clients, streaming and not. The in-process figure is LLMEngine
in this process at the same torch thread count, fed the same way (a new request as soon as one of
the `clients` finishes), with the core's OpenMP spin (bench/core_openmp.py). Each repeat runs every
case once, alternating in-process and HTTP, on fresh prompts; medians and ranges are reported, ratios
per repeat. --peft adds the naive-PEFT baseline of bench/lora_throughput.py's (d): transformers + PEFT
serving the same number of requests one at a time (bench/peft_baseline.py), run in each repeat before
its cases, and every side's ratio over it. Prints one JSON object; progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import core_openmp  # noqa: F401  (bench/core_openmp.py, first: this process spins as the engine core does)
import torch
from peft_baseline import NaivePeft  # bench/peft_baseline.py: run as `python bench/serving.py`
from stack import sse_events, stop  # bench/stack.py: run as `python bench/serving.py`
from tqdm import tqdm

from data_plane.adapters.loading.peft_loader import load_peft_adapter
from data_plane.config import EngineConfig
from data_plane.demo.adapters import DemoAdapter, write_lora_adapter
from data_plane.demo.model_builder import DemoModelShape, write_demo_model
from data_plane.engine.llm_engine import LLMEngine
from data_plane.engine.sampling_params import SamplingParams
from data_plane.engine.sequence import Request
from data_plane.lora.weights import TARGET_MODULES, LoRAAdapterWeights
from data_plane.model.config import ModelConfig
from shared.cpus import available_cpus

REPO = Path(__file__).resolve().parents[1]
_URL_LINE = re.compile(r"serving .* on (http://\S+)")
MAX_MODEL_LEN = 512


# ---- the model and adapters ------------------------------------------------------------------------
def build_model(args: argparse.Namespace, root: Path) -> Path:
    if args.model is not None:
        return args.model
    hidden, intermediate, layers, heads, kv_heads, vocab = (int(x) for x in args.shape.split(","))
    path = root / "model"
    write_demo_model(path, seed=0, shape=DemoModelShape(layers, hidden, heads, kv_heads, intermediate), vocab_size=vocab)
    actual = json.loads((path / "config.json").read_text())["vocab_size"]
    if actual != vocab:
        sys.exit(f"--shape asks for vocabulary {vocab}; the demo tokenizer has {actual}")
    return path


def build_adapters(args: argparse.Namespace, model: Path, root: Path) -> list[Path]:
    spec = DemoAdapter(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGET_MODULES)
    return [write_lora_adapter(model, root / f"adapter{i}", spec, seed=i) for i in range(args.adapters)]


# ---- servers -----------------------------------------------------------------------------------------
class Server:
    def __init__(self, model: Path, adapters: list[Path], threads: int, kind: str, log: Path, args,
                 extra: tuple[str, ...] = ()) -> None:
        cmd = [sys.executable, "-m", "shared.cli", "engine", "--model", str(model), "--served-model-name", "bench",
               "--port", "0", "--device", "cpu", "--num-threads", str(threads), "--max-model-len", str(MAX_MODEL_LEN),
               "--num-kv-blocks", "2048", "--max-num-seqs", "64", "--log-level", "warning",
               "--omp-threads-bind", args.omp_threads_bind]
        cmd.append("--engine-core-process" if kind == "core" else "--no-engine-core-process")
        if adapters:
            cmd += ["--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", str(args.rank),
                    "--lora-modules", *(f"a{i}={p}" for i, p in enumerate(adapters))]
        cmd += extra
        self.log = log
        # "default": an empty OMP_WAIT_POLICY, which the core keeps and libgomp reads as unset (spin a while, then sleep)
        policy = "" if args.omp_wait_policy == "default" else args.omp_wait_policy
        env = {**os.environ, "OMP_WAIT_POLICY": policy} if args.omp_wait_policy else None
        with log.open("w") as out:
            self.process = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.url = self._wait()

    def _wait(self) -> str:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                sys.exit(f"engine exited with {self.process.returncode}:\n{self.log.read_text()[-3000:]}")
            if match := _URL_LINE.search(self.log.read_text(errors="replace")):
                return match.group(1)
            time.sleep(0.2)
        sys.exit("engine did not start")

    def stop(self) -> None:
        stop(self.process)


# ---- the HTTP client process ---------------------------------------------------------------------
def client_main(conn) -> None:
    """Runs in its own process: each job is (url, prompts, models, clients, stream, output_len)."""
    import aiohttp

    async def one(session, url, prompt, model, stream, output_len) -> dict:
        body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": stream}
        start = time.perf_counter()
        stamps: list[float] = []
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{resp.status}: {await resp.text()}")
            if not stream:
                tokens = (await resp.json())["usage"]["completion_tokens"]
            else:  # every byte read, as a user would; the events a read completed are stamped on arrival
                tokens = 0
                async for now, event in sse_events(resp):
                    if event.startswith(b"data: ") and event != b"data: [DONE]":
                        stamps.append(now)
                        tokens += 1  # one event per token: each step's token is sent as it comes
        end = time.perf_counter()
        return {"start": start, "end": end, "tokens": tokens, "stamps": stamps}

    async def job(url, prompts, models, clients, stream, output_len) -> list[dict]:
        queue = list(zip(prompts, models, strict=True))
        results: list[dict] = []
        connector = aiohttp.TCPConnector(limit=clients)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
            async def worker() -> None:
                while queue:
                    prompt, model = queue.pop(0)
                    results.append(await one(session, url, prompt, model, stream, output_len))
            await asyncio.gather(*(worker() for _ in range(clients)))
        return results

    while (work := conn.recv()) is not None:
        conn.send(asyncio.run(job(*work)))


# ---- the in-process side --------------------------------------------------------------------------
def run_in_process(engine: LLMEngine, prompts, adapters, clients: int, output_len: int) -> list[dict]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    pending = list(enumerate(zip(prompts, adapters, strict=True)))
    records: dict[str, dict] = {}

    def admit() -> None:
        i, (prompt, (adapter_id, weights)) = pending.pop(0)
        rid = f"r{i}-{time.monotonic_ns()}"
        records[rid] = {"start": time.perf_counter(), "stamps": [], "tokens": 0}
        engine.add_request(Request(rid, prompt, params, adapter_id, weights.cache_namespace if weights else 0, weights))

    in_flight = 0
    while pending and in_flight < clients:
        admit()
        in_flight += 1
    while engine.has_work():
        for out in engine.step():
            rec = records[out.request_id]
            rec["stamps"].append(time.perf_counter())
            rec["tokens"] += sum(len(d.token_ids) for d in out.deltas)
            if out.finished:
                rec["end"] = rec["stamps"][-1]
                if pending:
                    admit()
    return list(records.values())


# ---- figures --------------------------------------------------------------------------------------
def summarize(records: list[dict]) -> dict:
    start = min(r["start"] for r in records)
    end = max(r["end"] for r in records)
    figures = {"tokens_per_s": sum(r["tokens"] for r in records) / (end - start)}
    ttft = [r["stamps"][0] - r["start"] for r in records if r["stamps"]]
    itl = [b - a for r in records for a, b in itertools.pairwise(r["stamps"])]
    e2e = [r["end"] - r["start"] for r in records]
    for name, values in (("ttft_ms", ttft), ("itl_ms", itl), ("e2e_ms", e2e)):
        if values:
            values = sorted(values)
            figures[f"{name}_p50"] = 1000 * values[len(values) // 2]
            figures[f"{name}_p99"] = 1000 * values[min(len(values) - 1, int(len(values) * 0.99))]
    return figures


def median_range(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2), "max": round(max(values), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a model directory (default: generate --shape)")
    parser.add_argument("--shape", default="512,1408,6,8,2,384", help="hidden,intermediate,layers,heads,kv_heads,vocab")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--min-requests", type=int, default=8, help="requests per case: max(clients, this)")
    parser.add_argument("--stream", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--torch-threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--servers", nargs="+", choices=["core", "thread"], default=["core", "thread"],
                        help="core: engine-core process; thread: --no-engine-core-process (the old path)")
    parser.add_argument("--omp-threads-bind", default="auto", help="passed to the servers")
    parser.add_argument("--omp-wait-policy", choices=["PASSIVE", "ACTIVE", "default"],
                        help="OMP_WAIT_POLICY of the servers (default: unset, libgomp's own)")
    parser.add_argument("--adapters", type=int, default=0, help="spread requests over N adapters (0: base model)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--peft", action="store_true",
                        help="with --adapters: also transformers + PEFT one adapter (and request) at a time, in this "
                        "process, once per repeat and torch thread count, alternated with the runs")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny model, few tokens, 1 repeat")
    args = parser.parse_args()
    if args.peft and not args.adapters:
        parser.error("--peft compares adapters: give --adapters N")
    if args.quick:
        args.shape, args.clients, args.torch_threads = "256,768,2,8,2,384", [1, 4], [1]
        args.prompt_len, args.output_len, args.repeats, args.min_requests = 16, 8, 1, 4

    root = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    model = build_model(args, root)
    adapter_dirs = build_adapters(args, model, root)
    model_config = ModelConfig.from_pretrained(model)
    weights: list[LoRAAdapterWeights] = [
        load_peft_adapter(d, model_config, max_rank=args.rank, allowed_roots=[str(root)]) for d in adapter_dirs]
    vocab = model_config.vocab_size
    streams = {"both": [False, True], "yes": [True], "no": [False]}[args.stream]

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    client = ctx.Process(target=client_main, args=(child_conn,), daemon=True)
    client.start()
    servers: dict[tuple[str, int], Server] = {}
    engines: dict[int, LLMEngine] = {}
    try:
        for threads in args.torch_threads:
            for kind in args.servers:
                servers[kind, threads] = Server(model, adapter_dirs, threads, kind, root / f"{kind}{threads}.log", args)
            torch.set_num_threads(threads)
            engines[threads] = LLMEngine.from_config(EngineConfig(
                model=str(model), device="cpu", num_threads=threads, max_model_len=MAX_MODEL_LEN, num_kv_blocks=2048,
                max_num_seqs=64, enable_lora=bool(weights), max_loras=max(1, len(weights)), max_lora_rank=args.rank,
                engine_core_process=False))
        warm = [[rng_i % (vocab - 10) + 10 for rng_i in range(args.prompt_len)]] * 2
        for threads in args.torch_threads:  # allocator, thread pools, the servers' first requests
            torch.set_num_threads(threads)
            run_in_process(engines[threads], warm, [(0, None)] * 2, 2, 4)
            for kind in args.servers:
                conn.send((servers[kind, threads].url, warm, ["bench"] * 2, 2, True, 4))
                conn.recv()
        cases = [(t, c, s) for t in args.torch_threads for c in args.clients for s in streams]
        runs: dict[tuple, dict[str, list[dict]]] = {case: {} for case in cases}
        peft = NaivePeft(model, adapter_dirs) if args.peft else None
        peft_tok_s: dict[int, list[float]] = {t: [] for t in args.torch_threads}  # per thread count, one per repeat
        rng = random.Random(0)
        total = args.repeats * (len(cases) * (1 + len(args.servers)) + (len(args.torch_threads) if peft else 0))
        with tqdm(total=total, desc="serving runs", file=sys.stderr) as bar:
            for _ in range(args.repeats):
                if peft is not None:
                    for threads in args.torch_threads:
                        torch.set_num_threads(threads)
                        jobs = [([rng.randrange(10, vocab) for _ in range(args.prompt_len)], i % len(weights))
                                for i in range(max(args.clients[-1], args.min_requests))]
                        peft_tok_s[threads].append(peft.tokens_per_s(jobs, args.output_len))
                        bar.update()
                for case in cases:
                    threads, clients, stream = case
                    n = max(clients, args.min_requests)
                    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(n)]
                    chosen = [(1 + i % len(weights), weights[i % len(weights)]) if weights else (0, None)
                              for i in range(n)]
                    names = [f"a{i % len(weights)}" if weights else "bench" for i in range(n)]
                    torch.set_num_threads(threads)
                    sides = [("in_process", None)] + [(f"http_{kind}", servers[kind, threads]) for kind in args.servers]
                    for side, server in sides:  # alternated within the repeat, on the same prompts
                        if server is None:
                            records = run_in_process(engines[threads], prompts, chosen, clients, args.output_len)
                        else:
                            conn.send((server.url, prompts, names, clients, stream, args.output_len))
                            records = conn.recv()
                        runs[case].setdefault(side, []).append(summarize(records))
                        bar.update()
        results = []
        for (threads, clients, stream), sides in runs.items():
            row: dict = {"torch_threads": threads, "clients": clients, "stream": stream}
            base = [r["tokens_per_s"] for r in sides["in_process"]]
            for side, figures in sides.items():
                # non-streaming HTTP answers once: its clients see tokens/s and end-to-end latency only
                row[side] = {k: median_range([f[k] for f in figures]) for k in figures[0] if all(k in f for f in figures)}
                if side != "in_process":
                    ratios = [f["tokens_per_s"] / b for f, b in zip(figures, base, strict=True)]
                    row[f"ratio_{side}_over_in_process"] = median_range(ratios)
                if peft is not None:  # each repeat's run over the same repeat's PEFT run
                    ratios = [f["tokens_per_s"] / n for f, n in zip(figures, peft_tok_s[threads], strict=True)]
                    row[f"ratio_{side}_over_peft"] = median_range(ratios)
            if peft is not None:
                row["peft_one_adapter_at_a_time"] = {"tokens_per_s": median_range(peft_tok_s[threads])}
            results.append(row)
    finally:
        conn.send(None)
        client.join(10)
        for server in servers.values():
            server.stop()
        for engine in engines.values():
            engine.shutdown()
    print(json.dumps({
        "benchmark": "serving",
        "model": str(args.model) if args.model else f"generated Qwen2 shape {args.shape}",
        "cpus": len(available_cpus()),
        "prompt_len": args.prompt_len, "output_len": args.output_len, "repeats": args.repeats,
        "min_requests": args.min_requests, "adapters": args.adapters, "rank": args.rank if args.adapters else None,
        "omp_threads_bind": args.omp_threads_bind, "omp_wait_policy": args.omp_wait_policy or "unset",
        "results": results,
    }))
    with contextlib.suppress(OSError):
        import shutil

        shutil.rmtree(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
