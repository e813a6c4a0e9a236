"""Inter-token latency of running streams while adapters hot-load, over HTTP against a real engine. One JSON
object.

    .venv/bin/python bench/hot_load.py [--shape 512,1408,6,8,2,384] [--streams 16] [--repeats 3]
        [--torch-threads 2] [--rank 16] [--readers process,thread] [--long-prefill-token-thresholds 256 0]

What bench/lora_throughput.py's figure (e) measures in process, as a client sees it: one `loraplane engine`
(engine-core process, --max-loras 4, four adapters registered at start with --lora-modules) serves
`--streams` streaming completions of two of them; this script's client runs in another process. In a
window that starts once every stream has 8 tokens, one of three things happens (rotated order each
repeat, after an uncounted warm-up round):
- steady: nothing (the window lasts 1.5 s);
- arrivals: six short requests (2 tokens) of the two other registered adapters, already in slots,
  50 ms apart: their prefills, no file read, no slot write (the baseline of the same arrivals). Each
  prompt starts with a number of its own, so the prefix cache holds none of it, as it holds none of a
  new adapter's first prompt (its cache namespace is new): with the streams' prompt, 16 of its 28
  tokens would be cached, and a step with an arrival would compute 12 prompt tokens against a hot
  load's 28;
- hot: six adapters never seen are loaded (POST /v1/load_lora_adapter: the engine reads and checks
  their files) and get one short request each, 50 ms apart: each is read, handed to the engine core,
  and written into a slot by the step that admits it, beside the running streams;
- slots: the same with six adapters loaded before the window: in it, only their hand-over to the core
  and their slot writes.
Windows are counted once the adapter readers have started (the engine's /metrics says so): the
warm-up's loads start them, at low priority, so on 2 busy CPUs they import torch for many seconds
while loads read on threads of the API process; `warm_up_hot_vs_steady` is that round's single hot
window against its steady one, and `counted_loads_read_on_api_threads_while_serving` how many counted
loads still did (0 when every one found a reader, waiting for a busy one if need be).
The arrival windows end when the last arrival has its answer. An inter-token latency is the time between
two consecutive tokens of one running stream, counted when the gap begins in the window (all streams share
each step, so one slow step is `--streams` long gaps). Reported per mode:
p50/p99 over the repeats (median, range), and per repeat the ratios hot/steady (target <= 1.5) and
hot/arrivals (what the loads add beside the arrivals' own prefills); and the p99 of all repeats' gaps
together, with its hot/steady ratio (an arrivals window has 10-20 steps, so its own p99 is its slowest one).

Two engines, alternated window by window in one run: one reads adapter files in its adapter reader
process (the default), the other on threads of its API process (--no-adapter-reader-process); the
`process_reader` and `thread_reader` blocks give each one's figures, `ratio_hot_p99_process_vs_thread`
the same repeat's hot p99 of one over the other. With several --long-prefill-token-thresholds, each reader's
engine runs once per threshold (blocks `process_threshold_0_reader`, ...), alternated as well, with each
threshold's hot p99 against the first's: at 0 the engine paces the arrivals' short prompts beside the
streams as it paces long ones (--decode-stall-limit), so their prefills no longer take one long step.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serving import Server, build_model  # bench/serving.py: run as `python bench/hot_load.py`
from stack import sse_events  # bench/stack.py
from tqdm import tqdm

from data_plane.config import LONG_PREFILL_TOKENS
from data_plane.demo.adapters import DemoAdapter, write_lora_adapter
from data_plane.lora.weights import TARGET_MODULES

RESIDENT = 4  # registered at start; the streams use the first two, the arrivals the other two
HOT = 6  # arrivals per window
ARRIVAL_GAP_S = 0.05
STEADY_WINDOW_S = 1.5
READER_START_FALLBACK_S = 30.0
PROMPT = "the quick brown fox jumps over the lazy dog"


def client_main(conn) -> None:
    """Runs in its own process: each job is (url, mode, streams, hot adapter paths) -> gaps and timings."""
    import aiohttp

    prompt_numbers = itertools.count()  # the arrivals' prompts: never one the prefix cache has seen

    async def stream(session, url, model, stamps: list[float]) -> None:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 480, "temperature": 0.0, "ignore_eos": True,
                "stream": True}
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"stream answered {resp.status}: {await resp.text()}")
            async for now, event in sse_events(resp):
                if event.startswith(b"data: {"):
                    stamps.append(now)

    async def short(session, url, model, prompt: str = PROMPT) -> float:
        started = time.perf_counter()
        body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{model} answered {resp.status}: {await resp.text()}")
            await resp.read()
        return time.perf_counter() - started

    async def hot(session, url, name, path) -> float:
        started = time.perf_counter()
        async with session.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}) as r:
            if r.status != 200:
                raise RuntimeError(f"load of {name} answered {r.status}: {await r.text()}")
        await short(session, url, name)
        return time.perf_counter() - started

    async def job(url: str, mode: str, streams: int, hot_paths: list[str]) -> dict:
        connector = aiohttp.TCPConnector(limit=streams + HOT + 4)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
            if mode == "arrivals":  # the arrivals' adapters into the two free slots, before the window
                for i in (2, 3):
                    await short(session, url, f"a{i}")
            if mode == "slots":  # the files read before the window: in it, only slot writes
                for path in hot_paths:
                    async with session.post(url + "/v1/load_lora_adapter",
                                            json={"lora_name": Path(path).name, "lora_path": path}) as r:
                        if r.status != 200:
                            raise RuntimeError(f"load of {path} answered {r.status}: {await r.text()}")
            stamps: list[list[float]] = [[] for _ in range(streams)]
            running = [asyncio.ensure_future(stream(session, url, f"a{i % 2}", stamps[i])) for i in range(streams)]
            while min(len(s) for s in stamps) < 8:
                if any(t.done() for t in running):
                    [t.result() for t in running if t.done()]  # raises what ended a stream early
                await asyncio.sleep(0.005)
            start = time.perf_counter()
            arrivals: list[asyncio.Future] = []
            if mode == "steady":
                await asyncio.sleep(STEADY_WINDOW_S)
            else:
                for k in range(HOT):
                    if mode == "hot":
                        name = Path(hot_paths[k]).name
                        arrivals.append(asyncio.ensure_future(hot(session, url, name, hot_paths[k])))
                    elif mode == "slots":
                        arrivals.append(asyncio.ensure_future(short(session, url, Path(hot_paths[k]).name)))
                    else:
                        fresh = f"{next(prompt_numbers)} {PROMPT}"  # a new adapter's first prompt's prefill
                        arrivals.append(asyncio.ensure_future(short(session, url, f"a{2 + k % 2}", fresh)))
                    await asyncio.sleep(ARRIVAL_GAP_S)
                await asyncio.gather(*arrivals)
            end = time.perf_counter()
            for task in running:
                task.cancel()  # closing the connections aborts the streams
            await asyncio.gather(*running, return_exceptions=True)
            if mode in ("hot", "slots"):
                for path in hot_paths:
                    async with session.post(url + "/v1/unload_lora_adapter", json={"lora_name": Path(path).name}) as r:
                        await r.read()
        # gaps that begin in the window (one that began before it is the streams' own start, not the window's)
        gaps = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if start <= a < end]
        return {"gaps": gaps, "window_s": end - start, "arrival_s": [a.result() for a in arrivals]}

    while (work := conn.recv()) is not None:
        conn.send(asyncio.run(job(*work)))


def rotated(items: list[str], r: int) -> list[str]:
    return items[r % len(items):] + items[: r % len(items)]


def summary(results: dict[str, list[dict]]) -> dict:
    """One server's figures: per mode p50/p99 over the repeats; per repeat the ratios against steady."""
    p99 = {m: [1e3 * p(o["gaps"], 0.99) for o in runs] for m, runs in results.items()}
    return {
        "itl_p50_ms": {m: spread([1e3 * p(o["gaps"], 0.5) for o in runs]) for m, runs in results.items()},
        "itl_p99_ms": {m: spread(v) for m, v in p99.items()},
        "gaps_per_window": {m: spread([len(o["gaps"]) for o in runs], 0) for m, runs in results.items()},
        "ratio_hot_vs_steady": spread([h / s for h, s in zip(p99["hot"], p99["steady"], strict=True)], 3)
        | {"target": "<= 1.5"},
        # every repeat's gaps together: a window of arrivals has only 10-20 steps, so its own p99 is its slowest
        # step; over all repeats, p99 is the slowest 1 % of the steps, as for steady
        "itl_p99_pooled_ms": {m: round(1e3 * p([g for o in runs for g in o["gaps"]], 0.99), 2)
                              for m, runs in results.items()},
        "ratio_hot_vs_steady_pooled": round(p([g for o in results["hot"] for g in o["gaps"]], 0.99)
                                            / p([g for o in results["steady"] for g in o["gaps"]], 0.99), 3),
        "ratio_hot_vs_arrivals": spread([h / a for h, a in zip(p99["hot"], p99["arrivals"], strict=True)], 3),
        "ratio_slot_writes_only_vs_steady": spread([w / s for w, s in zip(p99["slots"], p99["steady"], strict=True)], 3),
        "hot_load_and_answer_s": spread([s for o in results["hot"] for s in o["arrival_s"]], 3),
        "_hot_p99": p99["hot"],
    }


def ready(url: str) -> None:
    """Until the engine answers /health (its log line may come a moment before it listens)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"the engine at {url} never became healthy")
        time.sleep(0.1)


def reader_figures(url: str) -> dict[str, float]:
    """The engine's adapter reader gauges and counters (data_plane/adapters/loading/reader_process_metrics.py)."""
    figures = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(("loraplane_adapter_reader_processes{", "loraplane_adapter_reads_total{")):
            name, _, value = line.rpartition(" ")
            figures[name] = float(value)
    return figures


def wait_for_readers(url: str) -> float:
    """Seconds until the engine's adapter readers have started (the warm-up's loads start them, at low
    priority: on 2 busy CPUs they take many seconds to import torch, and until then loads read on API threads)."""
    started = time.monotonic()
    if not reader_figures(url):  # an engine from before these figures (an A/B against older code): a fixed wait
        time.sleep(READER_START_FALLBACK_S)
        return READER_START_FALLBACK_S
    while True:
        f = reader_figures(url)
        state = {s: f[f'loraplane_adapter_reader_processes{{state="{s}"}}'] for s in ("starting", "idle", "reading")}
        if state["starting"] == 0 and state["idle"] + state["reading"] > 0:
            return time.monotonic() - started
        if time.monotonic() - started > 300:
            sys.exit(f"the adapter readers at {url} never started: {state}")
        time.sleep(0.5)


def p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


def spread(values: list[float], digits: int = 2) -> dict:
    return {"median": round(statistics.median(values), digits),
            "range": [round(min(values), digits), round(max(values), digits)]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="512,1408,6,8,2,384", help="hidden,intermediate,layers,heads,kv_heads,vocab")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--readers", default="process,thread", type=lambda v: v.split(","),
                        help="engines to alternate: process (the adapter reader process, the default) and/or "
                        "thread (--no-adapter-reader-process)")
    parser.add_argument("--long-prefill-token-thresholds", type=int, nargs="+", default=[LONG_PREFILL_TOKENS],
                        metavar="TOKENS", help="each reader's engine once per threshold (the engine's "
                        "--long-prefill-token-threshold; 0 paces the arrivals' short prompts too), alternated")
    args = parser.parse_args()
    args.model, args.omp_threads_bind, args.omp_wait_policy = None, "auto", None  # what serving.Server reads

    root = Path(tempfile.mkdtemp(prefix="bench-hot-load-"))
    model = build_model(args, root)
    spec = DemoAdapter(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGET_MODULES)
    resident = [write_lora_adapter(model, root / f"a{i}", spec, seed=i) for i in range(RESIDENT)]
    rounds = args.repeats + 1  # the first is a warm-up
    hot = [[str(write_lora_adapter(model, root / f"hot{r}-{k}", spec, seed=100 + HOT * r + k)) for k in range(HOT)]
           for r in range(rounds)]
    slots = [[str(write_lora_adapter(model, root / f"slot{r}-{k}", spec, seed=500 + HOT * r + k)) for k in range(HOT)]
             for r in range(rounds)]
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    client = ctx.Process(target=client_main, args=(child_conn,), daemon=True)
    client.start()
    thresholds = args.long_prefill_token_thresholds
    kinds = {(reader if len(thresholds) == 1 else f"{reader}_threshold_{t}"): (reader, t)
             for reader in args.readers for t in thresholds}  # server name -> (reader, threshold)
    servers: dict[str, Server] = {}
    try:
        for name, (reader, threshold) in kinds.items():
            extra = ("--lora-roots", str(root))
            if thresholds != [LONG_PREFILL_TOKENS]:  # (the default: no flag, so an engine from before it serves too)
                extra += ("--long-prefill-token-threshold", str(threshold))
            extra += () if reader == "process" else ("--no-adapter-reader-process",)
            servers[name] = Server(model, resident, args.torch_threads, "core", root / f"engine-{name}.log", args,
                                   extra=extra)
            ready(servers[name].url)
        modes = ["steady", "arrivals", "hot", "slots"]
        results = {reader: {mode: [] for mode in modes} for reader in servers}
        warm_up: dict[str, dict] = {reader: {} for reader in servers}
        reader_start_s: dict[str, float] = {}
        reads_before: dict[str, dict] = {}
        reads_after: dict[str, dict] = {}
        with tqdm(total=rounds * len(modes) * len(servers), desc="hot-load windows", file=sys.stderr) as bar:
            for r in range(rounds):  # servers and modes alternate, in a rotated order each round
                for reader in rotated(list(servers), r):
                    for mode in rotated(modes, r):
                        conn.send((servers[reader].url, mode, args.streams, hot[r] if mode == "hot" else slots[r]))
                        outcome = conn.recv()
                        if r > 0:
                            results[reader][mode].append(outcome)
                        else:
                            warm_up[reader][mode] = outcome
                        bar.update()
                if r == 0:  # count only windows with the readers up: what a serving engine has after its first loads
                    for reader in servers:
                        if kinds[reader][0] == "process":
                            reader_start_s[reader] = round(wait_for_readers(servers[reader].url), 1)
                        reads_before[reader] = reader_figures(servers[reader].url)
            for reader in servers:
                reads_after[reader] = reader_figures(servers[reader].url)
    finally:
        conn.send(None)
        for server in servers.values():
            server.stop()
    by_reader = {reader: summary(runs) for reader, runs in results.items()}
    for reader, block in by_reader.items():
        # the warm-up round's hot window, whose loads met readers not started yet (one window: a figure to watch)
        block["warm_up_hot_vs_steady"] = round(p(warm_up[reader]["hot"]["gaps"], 0.99)
                                               / p(warm_up[reader]["steady"]["gaps"], 0.99), 3)
        if reader in reader_start_s:
            block["readers_started_after_warm_up_s"] = reader_start_s[reader]
            key = 'loraplane_adapter_reads_total{serving="true",where="api_thread"}'
            if key in reads_after[reader]:  # (an engine from before these figures has none)
                block["counted_loads_read_on_api_threads_while_serving"] = int(reads_after[reader][key]
                                                                               - reads_before[reader][key])
    figures = {
        "benchmark": "hot_load",
        "model": f"generated Qwen2 shape {args.shape}", "adapter_rank": args.rank, "adapter_targets": list(TARGET_MODULES),
        "engine": f"loraplane engine, engine-core process, --max-loras {RESIDENT}, {args.torch_threads} torch threads",
        "streams": args.streams, "repeats": args.repeats, "arrivals_per_window": HOT,
        "readers": {"process": "adapter reader process (the default)", "thread": "--no-adapter-reader-process"},
        "long_prefill_token_thresholds": thresholds,
        **{f"{reader}_reader": figures for reader, figures in by_reader.items()},
    }

    def hot_p99_ratio(a: str, b: str) -> dict:  # the same repeats' hot p99, one server against the other
        return spread([x / y for x, y in zip(by_reader[a]["_hot_p99"], by_reader[b]["_hot_p99"], strict=True)], 3)

    if {"process", "thread"} <= set(by_reader):
        figures["ratio_hot_p99_process_vs_thread"] = hot_p99_ratio("process", "thread")
    for name, (reader, threshold) in kinds.items():
        if len(thresholds) > 1 and threshold != thresholds[0]:
            figures[f"ratio_hot_p99_{name}_vs_threshold_{thresholds[0]}"] = hot_p99_ratio(
                name, f"{reader}_threshold_{thresholds[0]}")
    for block in by_reader.values():
        del block["_hot_p99"]
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
