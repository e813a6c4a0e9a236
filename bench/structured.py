"""Structured outputs over HTTP against a real `loraplane engine`: what a JSON schema's compile costs the
first token, and what constrained requests cost the unconstrained ones beside them. One JSON object.

    .venv/bin/python bench/structured.py [--model DIR | --demo] [--repeats 3] [--requests 8] [--adapters 32]
        [--requests-per-client 2] [--output-len 64] [--answers FILE] [--log FILE]

The model is bench/peer.py's (`loraplane demo-model --preset llama-250m` and its rank-16 adapters
lora-000 ..., bfloat16, written once to .peer-model/), served with bench/peer.py's flags; --demo serves the
small generated demo model instead (float32, adapters lora-000 ... written to a temporary folder), for
quick runs. One engine serves the whole run; this script's client runs in another process (streaming
completions, greedy). Every schema bounds its answer (enums, a pattern of at most 8 letters, maxItems)
well below its max_tokens, so each constrained answer ends with `stop`; each is parsed and checked
against its schema (`answers`; --answers FILE writes every one, with its schema, as JSON lines).

- single: one request at a time on the base model, N per repeat of each kind, alternated: `cold`, a
  schema never seen before (a property named after a counter: the API process compiles it, the engine
  core builds its matcher), against `warm`, one schema compiled before the run. TTFT median and range
  over every request of each kind; `cold_minus_warm_ms`, the median of the pairs' differences.
- mixed: --adapters concurrent streaming clients, client i on adapter lora-<i>, each sending
  --requests-per-client requests in turn. Three variants, in a rotated order each repeat: `plain` (no
  constraint), `mixed_warm` and `mixed_cold` (the even clients constrained by the warm schema, or by a
  new schema per request; the odd ones unconstrained). Unconstrained requests decode --output-len tokens
  (ignore_eos). Per variant and group (constrained, unconstrained, all): TTFT and ITL p50/p99, and the
  run's tok/s, median and range over the repeats; `unconstrained_vs_plain`: the unconstrained group's
  figures over the plain run's, paired by repeat, and `all_vs_plain` the same for every request together.
  `decode_step_ms` (under all): the median wall time of the engine core's decode-only steps with every
  client decoding (its DEBUG step log, as bench/peer.py reads it): the constrained rows' masks are in it.
  A constrained answer stops at its schema's end, shorter than --output-len, so a mixed run decodes
  fewer tokens than a plain one: its tok/s and its unconstrained rows' ITL (their last steps at half
  the batch) are not the plain run's on equal terms; decode_step_ms is.
- cache: the API process's compile cache (loraplane_structured_output_cache_hits_total, _misses_total
  on /metrics): its lookups during each variant, summed over the repeats.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
from peer import (
    FLAGS,
    MODEL_DIR,
    PRESET,
    SERVED_NAME,
    Server,
    cpu_model,
    decode_step_times,
    ensure_model,
    median_range,
    percentile,
    serve_clients,
    stream_completion,
)

CACHE_METRICS = {"hits": "loraplane_structured_output_cache_hits_total",
                 "misses": "loraplane_structured_output_cache_misses_total"}
DEMO_FLAGS = ("--dtype", "float32")  # after peer's FLAGS: the last one counts
CONSTRAINED_MAX_TOKENS = 160  # above any answer the schemas allow (under 100 characters, a token is at least one)
PROMPT = "Describe a pet as JSON:"
WARM_FIELD = "indoor"
VARIANTS = ("plain", "mixed_warm", "mixed_cold")


def progress(message: str) -> None:
    print(f"[structured {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def schema(field: str) -> dict[str, Any]:
    """A JSON schema whose answers are under 100 characters; `field` names its last property (a new name, a
    new schema: the compile cache has never seen it)."""
    return {
        "type": "object",
        "properties": {
            "kind": {"enum": ["cat", "dog", "fish", "bird"]},
            "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
            "tags": {"type": "array", "items": {"enum": ["old", "new", "big", "small"]}, "maxItems": 3},
            field: {"type": "boolean"},
        },
        "required": ["kind", "name", "tags", field],
        "additionalProperties": False,
    }


@dataclass(frozen=True)
class Job:
    """One request: the model it names, and its schema (None: unconstrained, --output-len tokens)."""

    model: str
    schema: dict[str, Any] | None


class Schemas:
    """The warm schema, and a new cold one on each call of cold()."""

    def __init__(self) -> None:
        self.warm = schema(WARM_FIELD)
        self._counter = itertools.count()

    def cold(self) -> dict[str, Any]:
        return schema(f"field_{next(self._counter)}")


# ---- the HTTP client process ---------------------------------------------------------------------
def client_main(conn: Any) -> None:
    """Runs in its own process: each work item is (url, [[Job, ...] per client], output_len); answers one
    record {start, end, tokens, stamps, text, finish, schema} per request (peer.stream_completion's, with
    the schema), or the error's text."""
    import aiohttp

    prompt_numbers = itertools.count()  # every prompt new: no request finds another's prefix cached

    async def one(session: aiohttp.ClientSession, url: str, job: Job, output_len: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": job.model, "prompt": f"{next(prompt_numbers)} {PROMPT}", "temperature": 0.0,
                                "stream": True, "stream_options": {"include_usage": True}}
        if job.schema is None:
            body |= {"max_tokens": output_len, "ignore_eos": True}
        else:
            body |= {"max_tokens": CONSTRAINED_MAX_TOKENS, "response_format": {
                "type": "json_schema", "json_schema": {"name": "pet", "schema": job.schema, "strict": True}}}
        return {**await stream_completion(session, url, body), "schema": job.schema}

    serve_clients(conn, one)


def drive(conn: Any, url: str, clients: list[list[Job]], output_len: int) -> list[dict[str, Any]]:
    conn.send((url, clients, output_len))
    answer = conn.recv()
    if isinstance(answer, str):
        sys.exit(f"the client failed against {url}: {answer}")
    records: list[dict[str, Any]] = answer
    return records


# ---- figures (pure) --------------------------------------------------------------------------------
def ttft(record: dict[str, Any]) -> float:
    if not record["stamps"]:
        raise ValueError(f"a request had no token: {record['text']!r}, finish {record['finish']}")
    return float(record["stamps"][0] - record["start"])


def group_figures(records: list[dict[str, Any]]) -> dict[str, float]:
    """TTFT and ITL p50/p99 in ms of a group of one run's requests."""
    ttfts = [ttft(r) for r in records]
    itl = [b - a for r in records for a, b in itertools.pairwise(r["stamps"])]
    figures = {"ttft_ms_p50": 1000 * percentile(ttfts, 50), "ttft_ms_p99": 1000 * percentile(ttfts, 99)}
    if itl:
        figures |= {"itl_ms_p50": 1000 * percentile(itl, 50), "itl_ms_p99": 1000 * percentile(itl, 99)}
    return figures


def run_figures(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """One mixed run's figures: per group (constrained, unconstrained, all), and the run's tok/s under all."""
    start, end = min(r["start"] for r in records), max(r["end"] for r in records)
    groups = {"constrained": [r for r in records if r["schema"] is not None],
              "unconstrained": [r for r in records if r["schema"] is None], "all": records}
    out = {name: group_figures(rs) for name, rs in groups.items() if rs}
    out["all"]["tokens_per_s"] = sum(r["tokens"] for r in records) / (end - start)
    return out


def answer_check(records: list[dict[str, Any]]) -> dict[str, int]:
    """How many constrained answers ended with stop, parsed as JSON, and validated against their schema."""
    counts = {"constrained": 0, "finish_stop": 0, "parsed": 0, "valid": 0}
    for record in records:
        if record["schema"] is None:
            continue
        counts["constrained"] += 1
        counts["finish_stop"] += record["finish"] == "stop"
        try:
            value = json.loads(record["text"])
        except ValueError:
            continue
        counts["parsed"] += 1
        with contextlib.suppress(jsonschema.ValidationError):
            jsonschema.validate(value, record["schema"])
            counts["valid"] += 1
    return counts


def across(runs: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Median and range over the repeats of each figure every run has."""
    return {k: median_range([r[k] for r in runs]) for k in runs[0] if all(k in r for r in runs)}


def paired(numerators: list[dict[str, float]], denominators: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Each figure of one list over the same repeat's in the other: median and range of the ratios."""
    keys = [k for k in numerators[0] if all(k in r for r in numerators + denominators)]
    return {k: median_range([a[k] / b[k] for a, b in zip(numerators, denominators, strict=True)]) for k in keys}


def rotated(items: tuple[str, ...], r: int) -> list[str]:
    return list(items[r % len(items):] + items[: r % len(items)])


def cache_counts(url: str) -> dict[str, float]:
    """The compile cache's hits and misses from the engine's /metrics."""
    counts = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        for key, metric in CACHE_METRICS.items():
            if name == metric:
                counts[key] = float(value)
    if set(counts) != set(CACHE_METRICS):
        sys.exit(f"{url}/metrics has no {set(CACHE_METRICS.values())}: an engine without structured outputs?")
    return counts


# ---- setup -----------------------------------------------------------------------------------------
def write_demo(root: Path, adapters: int) -> Path:
    """The demo model and `adapters` rank-8 adapters lora-000 ... under root/adapters, as bench/peer.py's
    Server finds them."""
    from data_plane.demo.adapters import DemoAdapter, write_lora_adapter
    from data_plane.demo.model_builder import write_demo_model
    from data_plane.lora.weights import TARGET_MODULES

    write_demo_model(root, seed=0)
    spec = DemoAdapter(r=8, lora_alpha=16, target_modules=TARGET_MODULES)
    for i in range(adapters):
        write_lora_adapter(root, root / "adapters" / f"lora-{i:03d}", spec, seed=i)
    return root


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--model", type=Path, default=MODEL_DIR,
                       help=f"the {PRESET} model directory, written with its adapters when missing "
                       f"(default {MODEL_DIR.name}/)")
    where.add_argument("--demo", action="store_true", help="the small generated demo model (quick runs)")
    parser.add_argument("--repeats", type=int, default=3, help="alternated runs of each variant")
    parser.add_argument("--requests", type=int, default=8, help="cold and warm single requests per repeat, each")
    parser.add_argument("--adapters", type=int, default=32, help="concurrent clients of the mixed runs, one adapter each")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=64, help="tokens of each unconstrained request")
    parser.add_argument("--answers", type=Path, help="write every constrained answer and its schema here (JSON lines)")
    parser.add_argument("--log", type=Path, help="keep the engine's log (DEBUG: its step lines) here")
    parser.add_argument("--server-timeout", type=float, default=900, help="seconds the engine may take to start")
    args = parser.parse_args(argv)
    for name in ("repeats", "requests", "requests_per_client", "output_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.adapters < 2:
        parser.error("--adapters must be at least 2 (half the clients are constrained)")
    return args


# ---- main ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    if args.demo:
        progress(f"writing the demo model and {args.adapters} adapters to {tmp}")
        model, extra = write_demo(tmp / "model", args.adapters), list(DEMO_FLAGS)
    else:
        ensure_model(args.model, args.adapters)
        model, extra = args.model, []
    schemas = Schemas()
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    client = ctx.Process(target=client_main, args=(child_conn,), daemon=True)
    client.start()
    single: dict[str, list[float]] = {"cold": [], "warm": []}
    mixed: dict[str, list[dict[str, dict[str, float]]]] = {v: [] for v in VARIANTS}
    cache = {v: {"hits": 0.0, "misses": 0.0} for v in ("single_cold", "single_warm", *VARIANTS)}
    answers: list[dict[str, Any]] = []
    server = None
    try:
        progress(f"starting the engine on {model}")
        server = engine = Server("loraplane", model, args.adapters, args.log or tmp / "engine.log", None, args.server_timeout, extra)
        url = engine.url or ""
        progress("warming up: every adapter once, the warm schema compiled")
        drive(conn, url, [[Job(f"lora-{i:03d}", None)] for i in range(args.adapters)], 2)
        answers += drive(conn, url, [[Job(SERVED_NAME, schemas.warm)]], 2)

        def measured(variant: str, clients: list[list[Job]]) -> tuple[list[dict[str, Any]], list[float]]:
            """The run's records, and the ms of its decode-only steps with every client decoding."""
            before, offset = cache_counts(url), engine.log_size()
            records = drive(conn, url, clients, args.output_len)
            after = cache_counts(url)
            for key in CACHE_METRICS:
                cache[variant][key] += after[key] - before[key]
            answers.extend(r for r in records if r["schema"] is not None)
            with engine.log.open("rb") as log:
                log.seek(offset)
                return records, decode_step_times(log.read().decode(errors="replace"), len(clients))

        for repeat in range(args.repeats):
            for i in range(args.requests):  # alternated: cold first on even requests
                for kind in ("cold", "warm") if i % 2 == 0 else ("warm", "cold"):
                    job = Job(SERVED_NAME, schemas.cold() if kind == "cold" else schemas.warm)
                    single[kind].append(ttft(measured(f"single_{kind}", [[job]])[0][0]))
            progress(f"repeat {repeat + 1}/{args.repeats} single: TTFT median cold "
                     f"{1000 * statistics.median(single['cold']):.0f} ms, warm {1000 * statistics.median(single['warm']):.0f} ms")
            for variant in rotated(VARIANTS, repeat):
                clients = []
                for c in range(args.adapters):
                    model_name = f"lora-{c:03d}"
                    constrained = variant != "plain" and c % 2 == 0
                    clients.append([Job(model_name, None if not constrained else
                                        schemas.warm if variant == "mixed_warm" else schemas.cold())
                                    for _ in range(args.requests_per_client)])
                records, steps = measured(variant, clients)
                figures = run_figures(records)
                if steps:
                    figures["all"]["decode_step_ms"] = statistics.median(steps)
                mixed[variant].append(figures)
                progress(f"repeat {repeat + 1}/{args.repeats} {variant}: {figures['all']['tokens_per_s']:.1f} tok/s, "
                         f"ITL p50 {figures['all'].get('itl_ms_p50', 0):.0f} ms")
    finally:
        conn.send(None)
        client.join(10)
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if args.answers:
        with args.answers.open("w") as out:
            for r in answers:
                out.write(json.dumps({"schema": r["schema"], "text": r["text"], "finish": r["finish"]}) + "\n")
    print(json.dumps(report(args, single, mixed, cache, answer_check(answers))))
    return 0


def report(args: argparse.Namespace, single: dict[str, list[float]], mixed: dict[str, list[dict[str, dict[str, float]]]],
           cache: dict[str, dict[str, float]], answers: dict[str, int]) -> dict[str, Any]:
    """The JSON object: single[kind] holds every request's TTFT in seconds, alternated pair by pair;
    mixed[variant] one run_figures per repeat, in repeat order."""
    ms = {kind: [1000 * t for t in values] for kind, values in single.items()}
    out_mixed: dict[str, Any] = {}
    for variant, runs in mixed.items():
        out_mixed[variant] = {group: across([r[group] for r in runs]) for group in runs[0]}
        if variant != "plain":
            out_mixed[variant]["unconstrained_vs_plain"] = paired([r["unconstrained"] for r in runs],
                                                                  [r["unconstrained"] for r in mixed["plain"]])
            out_mixed[variant]["all_vs_plain"] = paired([r["all"] for r in runs], [r["all"] for r in mixed["plain"]])
    return {
        "benchmark": "structured",
        "model": "loraplane demo-model (small Qwen2, float32)" if args.demo else
        f"loraplane demo-model --preset {PRESET} ({args.model})",
        "flags": " ".join(FLAGS + (DEMO_FLAGS if args.demo else ())),
        "cpu": cpu_model(), "cpus": len(os.sched_getaffinity(0)), "cpu_threads": os.cpu_count(),
        "repeats": args.repeats, "requests": args.requests, "adapters": args.adapters,
        "requests_per_client": args.requests_per_client, "output_len": args.output_len,
        "constrained_max_tokens": CONSTRAINED_MAX_TOKENS, "warm_schema": schema(WARM_FIELD),
        "single": {
            "cold": {"ttft_ms": median_range(ms["cold"]), "n": len(ms["cold"])},
            "warm": {"ttft_ms": median_range(ms["warm"]), "n": len(ms["warm"])},
            "cold_minus_warm_ms": median_range([c - w for c, w in zip(ms["cold"], ms["warm"], strict=True)]),
        },
        "mixed": out_mixed,
        "cache": {variant: {k: int(v) for k, v in counts.items()} for variant, counts in cache.items()},
        "answers": answers,
    }


if __name__ == "__main__":
    sys.exit(main())
