"""Adapter artifacts over loopback: a ~200 MB PEFT adapter uploaded into the control plane's
store, fetched and verified by an engine, and what that costs the first token and other adapters' decoding.
Prints one JSON object.

    .venv/bin/python bench/artifacts.py [--repeats 3] [--size-mb 200]

Real processes: `loraplane control` (SQLite, file:// store) and one `loraplane engine --control-plane …`
(CPU) whose --lora-cache-dir starts empty; this script is the HTTP client. The base is a random Qwen2 of
hidden 1024 whose depth and adapter rank are chosen to make the adapter about --size-mb (fp32, all seven
projections). Each repeat uploads two new adapters (new digests, so every fetch is cold) and measures,
in alternating order:
- upload: POST /v1/lora_adapters/{name}/versions (multipart, streamed from disk) → MB/s;
- cold load vs local disk: the engine's POST /v1/load_lora_adapter with `artifact` (fetch from the control
  plane, verify, cache, load) vs with `lora_path` (the same files under its --lora-roots), each timed to
  the first streamed token of a request to it; fetch+verify MB/s = size / (load call → the moment every
  sha256 matched in memory, which the cache marks by creating the version's folder under .partial/ to
  write it into, in the background, while the load parses the verified bytes; by then the weights are
  also in the adapter's host copy, copied as they arrived: data_plane/adapters/loading/staging.py);
- p99 inter-token latency of another (small) adapter's streaming decode while a cold fetch runs vs steady,
  with how long that fetch and its load took meanwhile (a fetch that waited for the decode to end, as an
  idle-class download thread did, is counted in loads_outliving_the_1500_token_decode).
Figures are medians over the repeats, with [min, max].

--prefault-mib: on a virtual machine whose host backs guest memory lazily (Firecracker, for one), the
first write into a page the guest never touched costs a host fault, several times a write into memory
touched before (docs/performance.md#artifacts), paid by whichever path happens to write new memory
first (new files' page cache, the loaded tensors). Touching that much memory once before the run and
freeing it lets the kernel hand those pages out again, so that the figures measure loraplane rather
than the hypervisor; 0 measures the machine as it comes. The JSON says which.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from stack import Stack, stack  # bench/stack.py: run as `python bench/artifacts.py`
from tqdm import tqdm

from data_plane.demo.adapters import DemoAdapter, write_lora_adapter
from data_plane.demo.model_builder import DemoModelShape, write_demo_model
from data_plane.lora.weights import TARGET_MODULES
from shared.peft import CONFIG_NAME, WEIGHTS_NAME

MB = 1e6
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 1024, 2048, 8, 4  # head_dim 128: q 1024 wide, k/v 512
# in + out features summed over the seven projections of one layer: a rank-r layer holds r * this floats
FEATURES_PER_LAYER = (2 * HIDDEN) * 2 + (HIDDEN + KV_HEADS * 128) * 2 + (HIDDEN + INTERMEDIATE) * 3
MAX_RANK = 512  # never above min(in, out) of any projection (k/v are 512 wide)
PROMPT = "The quick brown fox"
POLL_S = 0.002


def shape_for(size_mb: float) -> tuple[DemoModelShape, int]:
    """A base depth and an adapter rank whose fp32 adapter is about `size_mb`."""
    per_layer_at_max = FEATURES_PER_LAYER * MAX_RANK * 4
    layers = max(1, math.ceil(size_mb * MB / per_layer_at_max))
    rank = min(MAX_RANK, max(8, round(size_mb * MB / (layers * FEATURES_PER_LAYER * 4) / 8) * 8))
    return DemoModelShape(num_hidden_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
                          num_key_value_heads=KV_HEADS, intermediate_size=INTERMEDIATE), rank


def folder_bytes(folder: Path) -> int:
    return sum((folder / n).stat().st_size for n in (CONFIG_NAME, WEIGHTS_NAME))


def spread(values: list[float], digits: int = 1) -> dict:
    return {"median": round(statistics.median(values), digits),
            "range": [round(min(values), digits), round(max(values), digits)]}


class Bench:
    def __init__(self, s: Stack, cache: Path) -> None:
        self.s, self.cache = s, cache  # cache: the engine's --lora-cache-dir
        self.admin = s.admin()
        self.engine = httpx.Client(base_url=s.engine, timeout=600,
                                   headers={"Authorization": f"Bearer {s.engine_admin_token}"})
        self.outlived = 0  # loads during a decode that were still running when its 1,500 tokens ended
        self.load_calls: list[float] = []  # seconds of each first_token_s's load call (the rest: the request)

    def upload(self, name: str, folder: Path) -> tuple[str, float]:
        """(the version's digest, seconds) for one multipart upload streamed from disk, not activated."""
        with (folder / CONFIG_NAME).open("rb") as config, (folder / WEIGHTS_NAME).open("rb") as weights:
            files = {CONFIG_NAME: (CONFIG_NAME, config, "application/json"),
                     WEIGHTS_NAME: (WEIGHTS_NAME, weights, "application/octet-stream")}
            started = time.perf_counter()
            r = self.admin.post(f"/v1/lora_adapters/{name}/versions", files=files,
                                data={"base_model": "demo", "activate": "false"})
            seconds = time.perf_counter() - started
        if r.status_code != 200 or r.json()["engines"]:
            raise SystemExit(f"upload of {name} answered {r.status_code}: {r.text[:500]}")
        return r.json()["sha256"], seconds

    def load(self, name: str, **source: object) -> None:
        r = self.engine.post("/v1/load_lora_adapter", json={"lora_name": name, **source})
        if r.status_code != 200:
            raise SystemExit(f"load of {name} answered {r.status_code}: {r.text[:500]}")

    def unload(self, name: str) -> None:
        r = self.engine.post("/v1/unload_lora_adapter", json={"lora_name": name})
        if r.status_code != 200:
            raise SystemExit(f"unload of {name} answered {r.status_code}: {r.text[:500]}")

    def artifact(self, digest: str) -> dict:
        return {"artifact": {"digest": digest, "url": f"{self.s.cp}/v1/artifacts/{digest}"}}

    def stream(self, model: str, max_tokens: int, on_token: Callable[[float], bool]) -> None:
        """A streamed completion; `on_token(arrival time)` per token, until it returns False or the end."""
        body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                "temperature": 0}
        with self.engine.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise SystemExit(f"completion of {model} answered {r.status_code}: {r.read()[:500]!r}")
            for line in r.iter_lines():
                if line.startswith("data: {") and not on_token(time.perf_counter()):
                    return  # closing the stream aborts the request at the engine

    def first_token_s(self, name: str, **source: object) -> float:
        """Seconds from the load call to the first streamed token of a request to the loaded adapter."""
        started = time.perf_counter()
        self.load(name, **source)
        self.load_calls.append(time.perf_counter() - started)
        first: list[float] = []

        def on_token(t: float) -> bool:
            first.append(t)
            return False

        self.stream(name, 4, on_token)
        self.unload(name)
        return first[0] - started

    def cold_load(self, name: str, digest: str) -> tuple[float, float]:
        """(seconds to the first token, seconds to the verified folder in the cache) of an artifact load."""
        published = Watch(self.cache, digest)
        try:
            seconds = self.first_token_s(name, **self.artifact(digest))
        finally:
            published.stop()
        self.written(digest)
        return seconds, published.seen_after()

    def written(self, digest: str) -> None:
        """Wait for the engine's background write of `digest` into its cache (it starts once the load has
        its weights), so that the next measurement does not share the machine with it."""
        deadline = time.monotonic() + 120
        while not (self.cache / digest).is_dir():
            if time.monotonic() > deadline:
                raise SystemExit(f"{digest[:16]}… was never written into the engine's cache")
            time.sleep(POLL_S)

    def decode_gaps(self, model: str, during: Callable[[], list[float]] | None = None) -> list[list[float]]:
        """Inter-token gaps of `model`'s streaming decode. Steady: the 96 gaps after 8 tokens. With `during`
        (run in a thread once 8 tokens arrived; it answers the times [t0, t1, …] that bound its phases):
        per phase [t0, ti], the gaps that overlap it; the stream is closed when `during` returns."""
        arrivals: list[float] = []
        marks: list[float] = []
        worker = threading.Thread(target=lambda: marks.extend(during()) if during else None, daemon=True)

        def on_token(t: float) -> bool:
            arrivals.append(t)
            if during is None:
                return len(arrivals) < 8 + 97
            if len(arrivals) == 8:
                worker.start()
            return len(arrivals) <= 8 or worker.is_alive()

        self.stream(model, 1500, on_token)
        gaps = list(zip(arrivals[8:], arrivals[9:], strict=False))
        if during is None:
            return [[b - a for a, b in gaps]]
        if worker.is_alive():  # the stream ended on its own first: `during` waited for the engine to idle
            self.outlived += 1
        worker.join()
        if not marks:
            raise SystemExit("the load during the decode failed; see the engine's log")
        return [[b - a for a, b in gaps if b > marks[0] and a < end] for end in marks[1:]]


class Watch:
    """Records when the engine's cache has verified `digest`: its folder appears under .partial/ (to be
    written into) or, written already, in the cache itself."""

    def __init__(self, cache: Path, digest: str) -> None:
        self.path, self.partial = cache / digest, cache / ".partial"
        self.prefix, self.started, self.at = digest + ".", time.perf_counter(), None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self.at is None:
            stopping = self._stop.is_set()  # then one last look: the load may answer within a poll of the folder
            if self.path.exists() or any(n.startswith(self.prefix) and ".evicted." not in n
                                         for n in os.listdir(self.partial)):
                self.at = time.perf_counter()
            if stopping:
                return
            time.sleep(POLL_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def seen_after(self) -> float:
        if self.at is None:
            raise SystemExit(f"{self.path} never appeared in the engine's cache")
        return self.at - self.started


def p99(gaps: list[float]) -> float:
    if len(gaps) < 2:
        raise SystemExit(f"only {len(gaps)} inter-token gaps were measured; the phase was too short")
    return statistics.quantiles(gaps, n=100, method="inclusive")[98]


def prefault(mib: int) -> float:
    """Touch `mib` MiB of fresh memory once and free it (see --prefault-mib); returns the seconds it took."""
    started = time.perf_counter()
    # all held until the end: a block freed at once would give its pages to the next, touching nothing new
    blocks = [bytearray(64 << 20) for _ in range(mib // 64)]  # zero-filled: every page is written once
    del blocks
    return time.perf_counter() - started


def measure(bench: Bench, digests: tuple[str, str], folder: Path, tag: str, flip: bool,
            out: dict[str, list[float]]) -> None:
    """One repeat: cold artifact load (digests[0]) vs the same files from local disk (`folder`), and decode
    steady vs during a cold fetch (digests[1]); each pair in the order `flip` says."""
    size = folder_bytes(folder)

    def cold() -> None:
        ttft, fetch = bench.cold_load(f"cold-{tag}", digests[0])
        out["cold_s"].append(ttft)
        out["cold_load_call_s"].append(bench.load_calls[-1])
        out["fetch_mb_s"].append(size / MB / fetch)

    def local() -> None:
        out["local_s"].append(bench.first_token_s(f"local-{tag}", lora_path=str(folder)))
        out["local_load_call_s"].append(bench.load_calls[-1])

    def fetch_during() -> list[float]:
        published = Watch(bench.cache, digests[1])
        try:
            bench.load(f"during-{tag}", **bench.artifact(digests[1]))
        finally:
            published.stop()
        done = time.perf_counter()
        out["fetch_during_s"].append(published.seen_after())
        out["load_during_s"].append(done - published.started)
        return [published.started, published.started + published.seen_after(), done]

    def steady() -> None:
        out["steady_p99"].append(p99(bench.decode_gaps("small")[0]))

    def during() -> None:
        fetching, loading = bench.decode_gaps("small", fetch_during)
        bench.written(digests[1])  # held back while the decode ran; not beside the next measurement
        bench.unload(f"during-{tag}")
        out["fetching_p99"].append(p99(fetching))
        out["loading_p99"].append(p99(loading))
        out["fetching_gaps"].append(len(fetching))

    first, second = ((local, cold), (during, steady)) if flip else ((cold, local), (steady, during))
    for step in (*first, *second):
        os.sync()  # what this script wrote (new adapters, their upload) is on disk before anything is timed
        step()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size-mb", type=float, default=200)
    parser.add_argument("--control-plane-niceness", type=int, default=0,
                        help="run the control plane at this nice value: a stand-in for a control plane on another "
                             "host, whose serving of the bytes then takes no CPU from the engine's decoding")
    parser.add_argument("--prefault-mib", type=int, default=6144,
                        help="touch and free this much memory before the run (see the docstring); 0: none")
    args = parser.parse_args()
    prefault_s = prefault(args.prefault_mib)
    shape, rank = shape_for(args.size_mb)
    spec = DemoAdapter(r=rank, lora_alpha=rank, target_modules=TARGET_MODULES)
    progress = tqdm(total=2 + 3 * (args.repeats + 1), desc="artifacts benchmark", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        base, root, cache = tmp / "base", tmp / "adapters", tmp / "engine-cache"
        write_demo_model(base, seed=0, shape=shape)
        small = write_lora_adapter(base, root / "small", DemoAdapter(r=8, lora_alpha=16, target_modules=TARGET_MODULES),
                                   seed=1)
        progress.update()
        flags = ("--lora-cache-dir", str(cache), "--max-lora-rank", str(rank), "--max-loras", "2",
                 "--max-model-len", "2048", "--num-kv-blocks", "512")
        with stack(tmp, base, root, f"sqlite+aiosqlite:///{tmp / 'control.db'}", *flags,
                   control_plane_niceness=args.control_plane_niceness) as running:
            bench = Bench(running, cache)
            progress.update()
            bench.load("small", lora_path=str(small))
            uploads: list[float] = []
            out: dict[str, list[float]] = {k: [] for k in ("cold_s", "local_s", "fetch_mb_s", "steady_p99",
                                                           "fetching_p99", "loading_p99", "fetching_gaps", "fetch_during_s",
                                                           "load_during_s", "cold_load_call_s", "local_load_call_s")}
            for i in range(-1, args.repeats):  # -1: a warm-up round, not counted
                tag = "warm" if i < 0 else str(i)
                bench.outlived = 0 if i == 0 else bench.outlived  # the warm-up round is not counted
                digests = []
                for part in ("a", "b"):  # new random weights each time: a new digest, a cold fetch
                    folder = write_lora_adapter(base, root / f"big-{tag}-{part}", spec, seed=102 + 2 * i + len(digests))
                    digest, seconds = bench.upload(f"big-{tag}-{part}", folder)
                    digests.append(digest)
                    if i >= 0:
                        uploads.append(folder_bytes(folder) / MB / seconds)
                    progress.update()
                measure(bench, (digests[0], digests[1]), root / f"big-{tag}-a", tag, i % 2 == 1,
                        out if i >= 0 else {k: [] for k in out})
                progress.update()
            size_mb = folder_bytes(root / "big-0-a") / MB
    progress.close()
    ratios = [c / lo for c, lo in zip(out["cold_s"], out["local_s"], strict=True)]
    itl_ratios = [d / s for d, s in zip(out["fetching_p99"], out["steady_p99"], strict=True)]
    ms = [1e3 * x for x in out["steady_p99"]], [1e3 * x for x in out["fetching_p99"]]
    figures = {
        "benchmark": "artifacts",
        "machine": f"CPU only, {os.cpu_count()} cores shared by the control plane, the engine and this client",
        "adapter": {"size_mb": round(size_mb, 1), "rank": rank, "targets": list(TARGET_MODULES), "dtype": "float32",
                    "base": f"Qwen2, {shape.num_hidden_layers} layers, hidden {HIDDEN}, intermediate {INTERMEDIATE}, "
                            f"GQA {HEADS}/{KV_HEADS}"},
        "repeats": args.repeats,
        "control_plane_niceness": args.control_plane_niceness,
        "prefaulted_mib": args.prefault_mib, "prefault_s": round(prefault_s, 1),
        "upload_mb_s": spread(uploads),
        "fetch_verify_mb_s": spread(out["fetch_mb_s"]) | {"target": ">= 200"},
        "first_token_after_load_s": {
            "cold_engine_artifact": spread(out["cold_s"], 3), "local_disk_lora_path": spread(out["local_s"], 3),
            "ratio": round(statistics.median(out["cold_s"]) / statistics.median(out["local_s"]), 3),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)], "target": "ratio <= 1.5"},
        "other_adapter_itl_p99_ms": {
            "steady": spread(ms[0], 2), "while_fetching": spread(ms[1], 2),
            "ratio": round(statistics.median(ms[1]) / statistics.median(ms[0]), 3),
            "ratio_range": [round(min(itl_ratios), 3), round(max(itl_ratios), 3)],
            "while_loading_incl_slot_copy": spread([1e3 * x for x in out["loading_p99"]], 2),
            "gaps_per_fetch_window": spread(out["fetching_gaps"], 0),
            # the fetch must happen while the other adapter decodes, not wait for the engine to idle
            "fetch_while_decoding_s": spread(out["fetch_during_s"], 3),
            "load_while_decoding_s": spread(out["load_during_s"], 3),
            "loads_outliving_the_1500_token_decode": bench.outlived, "target": "ratio <= 1.5"},
        # each repeat's own figures: on a shared machine a repeat whose steady p99 jumps was disturbed
        "repeats_raw": [{"cold_s": round(c, 3), "cold_load_call_s": round(cl, 3), "local_s": round(lo, 3),
                         "local_load_call_s": round(ll, 3), "fetch_mb_s": round(f, 1),
                         "steady_p99_ms": round(1e3 * st, 1), "fetching_p99_ms": round(1e3 * fe, 1)}
                        for c, cl, lo, ll, f, st, fe in zip(out["cold_s"], out["cold_load_call_s"], out["local_s"],
                                                            out["local_load_call_s"], out["fetch_mb_s"],
                                                            out["steady_p99"], out["fetching_p99"], strict=True)],
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
