"""The fleet behind the router: adapter affinity vs spreading requests blindly. One JSON object.

    .venv/bin/python bench/fleet.py [--repeats 3] [--requests 240] [--concurrency 48] [--engine-threads 1]
        [--max-loras 4] [--omp-threads-bind nobind]

Real processes on loopback, all on this machine (CPU): stack A is `loraplane control` (SQLite) with three
`loraplane engine --control-plane … --max-loras 4` (or --max-loras N) and `loraplane router`; the 48 adapters are loaded
through the control plane with the default replicas {min 1, max 3}: each starts on one engine and demand
scaling (its window shortened to SCALE_WINDOW_S for these short runs) adds replicas to the hot ones. Stack B is three
plain engines with the same flags that each load all 48 adapters at start (`--lora-modules`): what a
fleet without a LoRA-aware router does. Both serve the same demo base model. Every engine core runs
--engine-threads torch threads (default 1): an engine alone on a host takes one per CPU below 4 CPUs
(data_plane/engine/core/threads.py), which with three busy engines on 2 CPUs puts six OpenMP threads on
two CPUs, each parallel region waiting at its barrier for a thread the scheduler has set aside. Every engine
gets --omp-threads-bind nobind (as `loraplane up --engines N` gives them), so every process may run on every
CPU; the engine's default, auto, would bind all six cores to the last CPU and their API processes to the
others, and the busy stack's three cores would then share one CPU while the client, the router, the control
plane and the API processes left the other partly idle (`--omp-threads-bind auto` runs that layout).

One request list (Zipf(1.0) over the 48 adapters, streamed completions of --max-tokens tokens) is sent
(a) through the router (stack A), (b) round-robin over stack B's engines, (c) to a random engine of
stack B, at the same concurrency, in rotated order each repeat, after one uncounted warm-up run of each. Reported per mode: output tokens/s,
TTFT p50/p99, the device-slot loads and evictions the engines counted (GET /v1/lora_stats, deltas),
`busiest_engine_share`: the requests the busiest engine served over all served (1/3 is an even spread),
`host_cpu_busy`: the busy share of all CPUs over the run (/proc/stat), and `cpu_us_per_token`: CPU
microseconds per output token of each part of the mode's stack (/proc/<pid>/stat): the engine cores, the
engines' API processes (with their adapter readers), for the router mode the router and the control plane,
and this process, the client. `engine_core_cpu_per_token_round_robin_over_router` is the engine cores' CPU
per output token of round-robin over the router mode's, per repeat, on this host: the compute that
adapter affinity saves the engines (fewer slot loads, fewer adapters per batch). It is not a throughput:
the router mode's load is less even (busiest_engine_share), and on this host the client, the API
processes, the router and the control plane take their share of the same two CPUs.
Then the router's own cost, against the engine that holds the adapter (stack A), alternated: p50 of a
1-token non-streaming completion, and streaming throughput of --streams concurrent long streams (two runs
each way per repeat, in ABBA order; the ratio is the repeat's summed tokens/s). Both use one more adapter,
`solo`, loaded with replicas {min 1, max 1} and sent no other traffic, so that the router has exactly the
one engine to choose that the direct side calls (a hot adapter, which demand scaling gives two or three
replicas, would let the router spread the streams over engines the direct side does not use).
Figures are medians over the repeats with [min, max], but each side's streaming tokens/s, which are over
every run (two per repeat). `slot_loads_offline_floor` is no measurement: the
fewest loads the same request lists allow (bench/fleet_floor.py: optimal eviction on --max-loras slots, requests
within concurrency/3 of each other on an engine sharing a load), for round-robin and for the best demand
placement, and `any_routing`, the fewest any routing allows (the fleet's 3 × --max-loras slots as one, the
whole concurrency sharing loads), against which the slot-loads target can be judged (null with a slot for
every adapter: the floor would count the first loads, which the warm-up takes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from fleet_floor import floors, zipf_adapters  # bench/fleet_floor.py
from stack import (  # bench/stack.py: run as `python bench/fleet.py`
    cpu_seconds,
    engine_admin_token,
    free_port,
    process,
)
from tqdm import tqdm

from data_plane.demo.adapters import DemoAdapter, write_lora_adapter
from data_plane.demo.model_builder import write_demo_model
from data_plane.engine.core.threads import CORE_MODULE, check_bind
from data_plane.lora.weights import TARGET_MODULES

ADAPTERS, ENGINES = 48, 3
SOLO = "solo"  # the router-cost figures' adapter: one replica, no Zipf traffic (module docstring)
SCALE_WINDOW_S = 5
STREAM_TOKENS = 200  # per stream of the routed-vs-direct streaming figure (--max-model-len is 256)
PROMPT_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards", "quietly", "hex"]
ENGINE_FLAGS = ("--device", "cpu", "--enable-lora", "--max-cpu-loras", str(ADAPTERS + 1),
                "--max-lora-rank", "8", "--max-model-len", "256", "--num-kv-blocks", "256", "--log-level", "warning")


def spread(values: list[float], digits: int = 1) -> dict:
    return {"median": round(statistics.median(values), digits),
            "range": [round(min(values), digits), round(max(values), digits)]}


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "shared.cli", *args]


@contextlib.contextmanager
def fleet(tmp: Path, base: Path, adapters: dict[str, Path], engine_threads: int = 1, max_loras: int = 4,
          bind: str = "nobind") -> Iterator[dict]:
    """Both stacks running, each engine core with `engine_threads` torch threads, `max_loras` device slots
    and `--omp-threads-bind bind`; yields URLs, tokens and the processes' pids (`pids`: "control_plane",
    "router", and the engines of each stack, "routed" and "plain")."""
    admin, router_token, engine_admin = (secrets.token_urlsafe(16) for _ in range(3))
    names = [f"fleet-{i}" for i in range(ENGINES)]
    creds = {n: secrets.token_urlsafe(16) for n in names}
    cp = f"http://127.0.0.1:{free_port()}"
    cp_env = {**os.environ, "LORAPLANE_ADMIN_TOKENS": admin, "LORAPLANE_ROUTER_TOKENS": router_token,
              "LORAPLANE_ENGINE_ADMIN_TOKEN": engine_admin, "LORAPLANE_DATABASE_URL": f"sqlite:///{tmp / 'cp.db'}",
              "LORAPLANE_ENGINE_CREDENTIALS": ",".join(f"{n}={t}" for n, t in creds.items()),
              "LORAPLANE_RECONCILE_INTERVAL_S": "2", "LORAPLANE_LOG_LEVEL": "warning",
              # demand scaling decides within seconds here (the default window is 30 s): the runs are short
              "LORAPLANE_SCALE_WINDOW_S": str(SCALE_WINDOW_S)}
    with contextlib.ExitStack() as stack:
        pids: dict[str, list[int]] = {"control_plane": [], "router": [], "routed": [], "plain": []}
        pids["control_plane"].append(stack.enter_context(process(
            cli("control", "--port", cp.rsplit(":", 1)[1], "--lora-roots", str(tmp)), cp_env, tmp / "control.log",
            cp)).pid)
        routed, plain = [], []
        engine_tokens: dict[str, str] = {}  # engine URL -> its admin token
        for n in names:
            url = f"http://127.0.0.1:{free_port()}"
            engine_tokens[url] = engine_admin_token(engine_admin, n)  # its own, as the control plane derives it
            env = {**os.environ, "LORAPLANE_ADMIN_TOKEN": engine_tokens[url], "LORAPLANE_CONTROL_PLANE_TOKEN": creds[n]}
            pids["routed"].append(stack.enter_context(process(
                cli("engine", "--model", str(base), "--served-model-name", "demo", "--port", url.rsplit(":", 1)[1],
                    "--control-plane", cp, "--engine-name", n, "--lora-cache-dir", str(tmp / f"cache-{n}"),
                    *ENGINE_FLAGS, "--num-threads", str(engine_threads), "--max-loras", str(max_loras),
                    "--omp-threads-bind", bind),
                env, tmp / f"{n}.log", url)).pid)
            routed.append(url)
        modules = [f"{name}={path}" for name, path in adapters.items()]
        for i in range(ENGINES):
            url = f"http://127.0.0.1:{free_port()}"
            engine_tokens[url] = engine_admin_token(engine_admin, f"plain-{i}")
            env = {**os.environ, "LORAPLANE_ADMIN_TOKEN": engine_tokens[url]}
            pids["plain"].append(stack.enter_context(process(
                cli("engine", "--model", str(base), "--served-model-name", "demo", "--port", url.rsplit(":", 1)[1],
                    "--lora-modules", *modules, *ENGINE_FLAGS, "--num-threads", str(engine_threads),
                    "--max-loras", str(max_loras), "--omp-threads-bind", bind),
                env, tmp / f"plain-{i}.log", url)).pid)
            plain.append(url)
        router = f"http://127.0.0.1:{free_port()}"
        pids["router"].append(stack.enter_context(process(
            cli("router", "--control-plane", cp, "--port", router.rsplit(":", 1)[1], "--log-level", "warning"),
            {**os.environ, "LORAPLANE_ROUTER_TOKEN": router_token}, tmp / "router.log", router)).pid)
        yield {"cp": cp, "admin": admin, "engine_tokens": engine_tokens, "routed": routed, "plain": plain,
               "router": router, "pids": pids}


def load_adapters(f: dict, adapters: dict[str, Path]) -> dict[str, str]:
    """Load every adapter through the control plane (default replicas: min 1, max 3, by demand); answers
    adapter -> the URL of an engine that holds it."""
    with httpx.Client(base_url=f["cp"], headers={"Authorization": f"Bearer {f['admin']}"}, timeout=120) as cp:
        deadline = time.monotonic() + 60
        while len([e for e in cp.get("/v1/engines").json()["data"] if e["state"] == "healthy"]) < ENGINES:
            if time.monotonic() > deadline:
                raise SystemExit("the engines did not all register with the control plane")
            time.sleep(0.3)
        for name, path in adapters.items():
            body = {"lora_name": name, "lora_path": str(path), "base_model": "demo"}
            if name == SOLO:
                body["replicas"] = {"min": 1, "max": 1}
            r = cp.post("/v1/load_lora_adapter", json=body)
            if r.status_code != 200:
                raise SystemExit(f"load of {name} answered {r.status_code}: {r.text[:300]}")
        deadline = time.monotonic() + 120
        while True:  # every adapter held (device or host) by an engine
            routes = cp.get("/v1/routes").json()
            urls = {e["name"]: e["url"] for e in routes["engines"]}
            held = {m["model"]: [h for h in m["holders"] if h["residency"] != "loading"]
                    for m in routes["models"] if m["kind"] == "adapter"}
            if len(held) == len(adapters) and all(held.values()):
                return {name: urls[h[0]["engine"]] for name, h in held.items()}
            if time.monotonic() > deadline:
                raise SystemExit(f"adapters not all placed: {held}")
            time.sleep(0.5)


def request_list(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    weights = [1 / (k + 1) for k in range(ADAPTERS)]  # Zipf(1.0)
    models = rng.choices([f"a{k:02d}" for k in range(ADAPTERS)], weights=weights, k=n)
    return [(m, " ".join(rng.choices(PROMPT_WORDS, k=12))) for m in models]


async def stream_one(http: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """(TTFT seconds, tokens) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    started, first, tokens = time.perf_counter(), None, 0
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url} answered {r.status_code} for {model}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                first = first or time.perf_counter()
                tokens += 1
    return (first or time.perf_counter()) - started, tokens


async def run_mode(urls: list[str], pick: str, requests: list[tuple[str, str]], concurrency: int,
                   max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    targets = [urls[0] if pick == "router" else urls[i % len(urls)] if pick == "round_robin" else rng.choice(urls)
               for i in range(len(requests))]
    queue = list(zip(requests, targets, strict=True))
    ttfts: list[float] = []
    tokens = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        async def worker() -> None:
            nonlocal tokens
            while queue:
                (model, prompt), url = queue.pop(0)
                ttft, n = await stream_one(http, url, model, prompt, max_tokens)
                ttfts.append(ttft)
                tokens += n
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    return {"tokens_per_s": tokens / seconds, "ttft_p50_ms": 1e3 * pct(ttfts, 50), "ttft_p99_ms": 1e3 * pct(ttfts, 99),
            "tokens": tokens}


def process_cpu_s(pid: int, reaped_children: bool = False) -> float:
    """cpu_seconds, 0 once the process is gone (`reaped_children`: a child gone between two readings still
    counts)."""
    try:
        return cpu_seconds(pid, reaped_children)
    except OSError:
        return 0.0


def child_pids(pid: int) -> list[int]:
    """The live children of `pid` (of every thread of it)."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def cpu_by_role(pids: dict[str, list[int]], engines: str) -> dict[str, float]:
    """CPU seconds used so far by the processes of one stack: the engines of the group `engines` ("routed"
    or "plain") split into their engine-core children and the rest (the API processes with their adapter
    readers, those that ended too); the router and the control plane with the routed stack; and this
    process, the client."""
    cores = apis = 0.0
    for pid in pids[engines]:
        apis += process_cpu_s(pid, reaped_children=True)
        for child in child_pids(pid):
            with contextlib.suppress(OSError):
                is_core = CORE_MODULE.encode() in Path(f"/proc/{child}/cmdline").read_bytes()
                if is_core:
                    cores += process_cpu_s(child)
                else:
                    apis += process_cpu_s(child)
    usage = os.times()
    out = {"engine_cores": cores, "engine_apis": apis, "client": usage.user + usage.system}
    if engines == "routed":
        out |= {"router": sum(map(process_cpu_s, pids["router"])),
                "control_plane": sum(map(process_cpu_s, pids["control_plane"]))}
    return out


def host_busy() -> tuple[int, int]:
    """(busy, total) jiffies of every CPU so far (/proc/stat's first eight: user nice system idle iowait irq
    softirq steal; the guest times after them are inside user and nice; idle, iowait and steal are not busy)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(values) - values[3] - values[4] - values[7], sum(values)


def slot_counters(urls: list[str], tokens: dict[str, str]) -> tuple[int, int, list[int]]:
    """(device-slot loads, evictions, adapter requests per engine) the engines counted so far."""
    loads = evictions = 0
    served = []
    for url in urls:
        stats = httpx.get(f"{url}/v1/lora_stats", headers={"Authorization": f"Bearer {tokens[url]}"},
                          timeout=30).json()
        loads += sum(a["loads"] for a in stats["adapters"])
        evictions += sum(a["evictions"] for a in stats["adapters"])
        served.append(sum(sum(a["requests"].values()) for a in stats["adapters"]))
    return loads, evictions, served


async def overhead(router: str, holder: str, model: str, n: int) -> tuple[float, float]:
    """p50 seconds of a 1-token non-streaming completion via the router and direct, alternated."""
    via, direct = [], []
    body = {"model": model, "prompt": "hello", "max_tokens": 1, "temperature": 0}
    async with httpx.AsyncClient(timeout=60) as http:
        for i in range(2 * n):
            url = router if i % 2 == 0 else holder
            started = time.perf_counter()
            r = await http.post(f"{url}/v1/completions", json=body)
            (via if url == router else direct).append(time.perf_counter() - started)
            if r.status_code != 200:
                raise SystemExit(f"{url} answered {r.status_code}: {r.text[:300]}")
    return statistics.median(via), statistics.median(direct)


async def streaming(url: str, model: str, streams: int, max_tokens: int) -> float:
    async with httpx.AsyncClient(timeout=600) as http:
        started = time.perf_counter()
        done = await asyncio.gather(*(stream_one(http, url, model, "once upon a time", max_tokens)
                                      for _ in range(streams)))
        return sum(n for _, n in done) / (time.perf_counter() - started)


def streaming_pairs(router: str, holder: str, streams: int, rep: int) -> tuple[list[float], list[float]]:
    """Tokens/s of --streams concurrent streams via the router and direct, twice each in ABBA order (BAAB
    on odd repeats): neither side always runs first, right after the Zipf runs' placement changes settle."""
    sides = (router, holder)
    order = (0, 1, 1, 0) if rep % 2 == 0 else (1, 0, 0, 1)
    tps: tuple[list[float], list[float]] = ([], [])
    for side in order:
        tps[side].append(asyncio.run(streaming(sides[side], SOLO, streams, STREAM_TOKENS)))
    return tps


def bind_value(text: str) -> str:
    """--omp-threads-bind as the engines take it (auto, nobind or a CPU list), checked here before six start."""
    try:
        check_bind(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: auto, nobind or a CPU list such as 1-3 ({exc})") from exc
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--overhead-requests", type=int, default=200)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--engine-threads", type=int, default=1,
                        help="torch threads of each engine core (default 1: six engines share this host's CPUs, and "
                             "an engine alone would take one per CPU, so three busy ones would oversubscribe them)")
    parser.add_argument("--max-loras", type=int, default=4,
                        help="device slots of every engine (default 4; --max-loras 48, a slot for every "
                             "adapter, gives the stacks' ceiling with no slot ever loaded twice)")
    parser.add_argument("--omp-threads-bind", default="nobind", type=bind_value,
                        help="every engine's --omp-threads-bind (default nobind, as `loraplane up --engines N` starts "
                             "them; the engine's own default, auto, binds every engine core to the last CPU and every "
                             "API process to the others)")
    args = parser.parse_args()
    if args.engine_threads < 1 or not 1 <= args.max_loras <= ADAPTERS:
        parser.error(f"--engine-threads must be at least 1 and --max-loras within 1-{ADAPTERS}")
    modes = ("router", "round_robin", "random")
    progress = tqdm(total=2 + args.repeats * (len(modes) + 2), desc="fleet benchmark", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        base = tmp / "base"
        write_demo_model(base, seed=0)
        spec = DemoAdapter(r=8, lora_alpha=16, target_modules=TARGET_MODULES)
        adapters = {f"a{k:02d}": write_lora_adapter(base, tmp / "adapters" / f"a{k:02d}", spec, seed=100 + k)
                    for k in range(ADAPTERS)}
        solo = write_lora_adapter(base, tmp / "adapters" / SOLO, spec, seed=99)
        progress.update()
        with fleet(tmp, base, adapters, args.engine_threads, args.max_loras, args.omp_threads_bind) as f:
            holders = load_adapters(f, adapters | {SOLO: solo})  # solo: stack A only
            progress.update()
            urls = {"router": [f["router"]], "round_robin": f["plain"], "random": f["plain"]}
            counted = {"router": f["routed"], "round_robin": f["plain"], "random": f["plain"]}
            stacks = {"router": "routed", "round_robin": "plain", "random": "plain"}
            cpu_per_token: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
            out: dict[str, list[dict]] = {m: [] for m in modes}
            via_p50, direct_p50, stream_ratio = [], [], []
            stream_tps: dict[str, list[float]] = {"router": [], "direct": []}
            for mode in modes:  # warm-up, not counted: slots filled, demand scaling settled
                asyncio.run(run_mode(urls[mode], mode, request_list(args.requests, 99), args.concurrency,
                                     args.max_tokens, 99))
            for rep in range(args.repeats):
                requests = request_list(args.requests, seed=rep)
                for mode in modes[rep % 3:] + modes[:rep % 3]:
                    before = slot_counters(counted[mode], f["engine_tokens"])
                    cpu_before, busy_before = cpu_by_role(f["pids"], stacks[mode]), host_busy()
                    figures = asyncio.run(run_mode(urls[mode], mode, requests, args.concurrency, args.max_tokens, rep))
                    tokens = figures.pop("tokens")
                    cpu_after, busy_after = cpu_by_role(f["pids"], stacks[mode]), host_busy()
                    after = slot_counters(counted[mode], f["engine_tokens"])
                    served = [a - b for a, b in zip(after[2], before[2], strict=True)]
                    out[mode].append(figures | {"slot_loads": after[0] - before[0],
                                                "evictions": after[1] - before[1],
                                                "busiest_engine_share": max(served) / max(sum(served), 1),
                                                "host_cpu_busy": (busy_after[0] - busy_before[0])
                                                / max(busy_after[1] - busy_before[1], 1)})
                    cpu_per_token[mode].append({role: 1e6 * (cpu_after[role] - cpu_before[role]) / max(tokens, 1)
                                                for role in cpu_after})
                    progress.update()
                via, direct = asyncio.run(overhead(f["router"], holders[SOLO], SOLO, args.overhead_requests))
                via_p50.append(via)
                direct_p50.append(direct)
                progress.update()
                routed_tps, direct_tps = streaming_pairs(f["router"], holders[SOLO], args.streams, rep)
                stream_tps["router"] += routed_tps
                stream_tps["direct"] += direct_tps
                stream_ratio.append(sum(routed_tps) / sum(direct_tps))
                progress.update()
    progress.close()

    def summary(mode: str) -> dict:
        rows = out[mode]
        digits = {"slot_loads": 0, "evictions": 0, "busiest_engine_share": 3, "host_cpu_busy": 3}
        return {k: spread([r[k] for r in rows], digits.get(k, 1)) for k in rows[0]} | {
            "cpu_us_per_token": {role: spread([r[role] for r in cpu_per_token[mode]])
                                 for role in cpu_per_token[mode][0]}}

    tps = {m: [r["tokens_per_s"] for r in out[m]] for m in modes}
    loads = {m: [r["slot_loads"] for r in out[m]] for m in modes}
    ratios = [a / b for a, b in zip(tps["router"], tps["round_robin"], strict=True)]
    core_cpu = {m: [r["engine_cores"] for r in cpu_per_token[m]] for m in modes}
    load_ratios = [a / max(b, 1) for a, b in zip(loads["router"], loads["round_robin"], strict=True)]
    overhead_ms = [1e3 * (v - d) for v, d in zip(via_p50, direct_p50, strict=True)]
    floor = [floors(zipf_adapters(args.requests, rep), args.max_loras, args.concurrency // ENGINES, ENGINES)
             for rep in range(args.repeats)]
    print(json.dumps({
        "benchmark": "fleet",
        "machine": f"CPU only, {os.cpu_count()} cores shared by 6 engines, the control plane, the router and the client",
        "setup": {"engines": ENGINES, "max_loras": args.max_loras, "adapters": ADAPTERS,
                  "traffic": "Zipf(1.0) over adapters",
                  "router_cost_adapter": f"{SOLO}: replicas {{min 1, max 1}}, no Zipf traffic",
                  "requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                  "repeats": args.repeats, "engine_threads": args.engine_threads,
                  "omp_threads_bind": args.omp_threads_bind,
                  "model": "demo (Qwen2-style, 4 layers, hidden 256)", "adapter_rank": 8},
        "modes": {m: summary(m) for m in modes},
        "router_vs_round_robin": {
            "tokens_per_s_ratio": spread(ratios, 3) | {"target": ">= 1.3"},
            "slot_loads_ratio": spread(load_ratios, 3) | {"target": "<= 0.25"},
            # engine-core CPU per token on this host, round-robin over router (not a throughput: the router
            # mode's load is less even, busiest_engine_share)
            "engine_core_cpu_per_token_round_robin_over_router": spread(
                [b / a for a, b in zip(core_cpu["router"], core_cpu["round_robin"], strict=True)], 3)},
        # the floor counts every adapter's first load, which the warm-up round takes here: with a slot for
        # every adapter that is all it would count, against the few loads measured after the warm-up
        "slot_loads_offline_floor": None if args.max_loras == ADAPTERS else {
            "round_robin": spread([f["round_robin"] for f in floor], 0),
            "demand_placed": spread([f["demand_placed"] for f in floor], 0),
            "demand_placed_over_measured_round_robin": spread(
                [f["demand_placed"] / max(b, 1) for f, b in zip(floor, loads["round_robin"], strict=True)], 3),
            "any_routing": spread([f["any_routing"] for f in floor], 0),
            "any_routing_over_measured_round_robin": spread(
                [f["any_routing"] / max(b, 1) for f, b in zip(floor, loads["round_robin"], strict=True)], 3)},
        "router_overhead_1_token_p50_ms": spread(overhead_ms, 2) | {
            "via_router_ms": spread([1e3 * v for v in via_p50], 2), "direct_ms": spread([1e3 * d for d in direct_p50], 2),
            "target": "<= 2"},
        "routed_streaming_throughput_ratio": spread(stream_ratio, 3) | {
            "streams": args.streams, "tokens_per_stream": STREAM_TOKENS,
            "via_router_tokens_per_s": spread(stream_tps["router"]), "direct_tokens_per_s": spread(stream_tps["direct"]),
            "target": ">= 0.95"},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
