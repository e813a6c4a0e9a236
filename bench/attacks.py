"""Replays known attacks on the admin and inference APIs against a real control plane and engine and
prints one JSON object: per attack, the status answered, the seconds it took, and whether the engine
still served a normal request and answered /health afterwards.

    .venv/bin/python bench/attacks.py

Every target is on loopback; each attack is one bounded request (the slow-engine and SSRF peers are
addresses that are never connected to: they must be refused before any call).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from stack import Stack, stack  # bench/stack.py: run as `python bench/attacks.py`
from tqdm import tqdm

from data_plane.demo.adapters import write_demo_adapters
from data_plane.demo.model_builder import write_demo_model

Attack = Callable[[Stack, httpx.Client], httpx.Response]


def completion(**body: object) -> dict:
    return {"model": "demo", "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0, **body}


def post_engine(path: str, body: object) -> Attack:
    return lambda s, _: httpx.post(s.engine + path, json=body, timeout=120)


def register(url: str) -> Attack:
    return lambda s, admin: admin.post("/v1/engines/register", json={"name": "evil", "url": url, "base_model": "x"})


def load_cp(name: str, path: str, **extra: object) -> Attack:
    return lambda s, admin: admin.post("/v1/load_lora_adapter",
                                       json={"lora_name": name, "lora_path": path, "base_model": "demo", **extra})


def health_while(attack: Attack) -> Attack:
    """Run `attack` and, meanwhile, time /health: it must not wait for the attack."""
    def run(s: Stack, admin: httpx.Client) -> httpx.Response:
        box: dict[str, httpx.Response] = {}
        worker = threading.Thread(target=lambda: box.setdefault("r", attack(s, admin)))
        worker.start()
        time.sleep(0.05)
        started = time.monotonic()
        httpx.get(s.engine + "/health", timeout=60)
        box["health_s"] = time.monotonic() - started  # type: ignore[assignment]
        worker.join()
        response = box["r"]
        response.extensions["health_s"] = box["health_s"]
        return response
    return run


def attacks(root: Path) -> dict[str, Attack]:
    poet = str(root / "demo-poet")
    return {
        "1.1 seed 2**64-1 with n 2": post_engine("/v1/completions", completion(seed=2**64 - 1, n=2)),
        "1.2 n 10000": post_engine("/v1/completions", completion(n=10000, max_tokens=8)),
        "1.2 200000 stop strings": post_engine("/v1/completions", completion(stop=["x"] * 200_000)),
        "1.2 17 stop strings": post_engine("/v1/completions", completion(stop=[f"s{i}" for i in range(17)])),
        "1.3 register http://169.254.169.254": register("http://169.254.169.254"),
        "1.3 register http://0x7f.1:8000": register("http://0x7f.1:8000"),
        "1.3 register userinfo": register("http://user:pw@127.0.0.1:9"),
        "1.3 register with a query": register("http://127.0.0.1:9/?x="),
        "1.4 model ../lora_stats": post_engine("/v1/completions", completion(model="../lora_stats")),
        "1.7 8 MB prompt (/health meanwhile)": health_while(
            post_engine("/v1/completions", completion(prompt="a " * 4_000_000))),
        "1.8 name with a trailing newline (control plane)": load_cp("poet\n", poet),
        "1.8 name with a bidi control (engine)": lambda s, _: httpx.post(
            s.engine + "/v1/load_lora_adapter", json={"lora_name": "po\u202eet", "lora_path": poet},
            headers={"Authorization": f"Bearer {s.engine_admin_token}"}, timeout=60),
        "1.8 name equal to the base model": load_cp("demo", poet),
        "1.8 NUL in the path": load_cp("nul", poet + "\0x"),
        "1.8 2000-character path": load_cp("long", str(root) + "/" + "a" * 2000),
        "1.8 20000 labels": load_cp("labels", poet, labels={f"k{i}": "v" for i in range(20_000)}),
    }


def still_serving(s: Stack) -> bool:
    ok = httpx.post(s.engine + "/v1/completions", json=completion(), timeout=60).status_code == 200
    return ok and httpx.get(s.engine + "/health", timeout=10).status_code == 200


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip", nargs="*", default=[], metavar="PREFIX",
                        help="leave out attacks whose name starts with PREFIX (e.g. 1.1, which kills an "
                             "unhardened engine and so hides what the later attacks would do)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        base = tmp / "demo"
        write_demo_model(base, seed=0)
        root = tmp / "adapters"
        write_demo_adapters(base, root)
        results: dict[str, dict] = {}
        with stack(tmp, base, root, f"sqlite+aiosqlite:///{tmp / 'control.db'}", "--max-request-body-bytes",
                   str(16 << 20)) as running, running.admin() as admin:
            chosen = {n: a for n, a in attacks(root).items() if not any(n.startswith(p) for p in args.skip)}
            for name, attack in tqdm(chosen.items(), desc="attacks", file=sys.stderr):
                started = time.monotonic()
                try:
                    r = attack(running, admin)
                    outcome: dict = {"status": r.status_code, "seconds": round(time.monotonic() - started, 3)}
                    if r.status_code >= 400:
                        error = r.json().get("error", {}) if "json" in r.headers.get("content-type", "") else {}
                        outcome["message"] = str(error.get("message", ""))[:160]
                    if "health_s" in r.extensions:
                        outcome["health_during_s"] = round(r.extensions["health_s"], 3)
                except httpx.HTTPError as exc:
                    outcome = {"status": type(exc).__name__, "seconds": round(time.monotonic() - started, 3)}
                outcome["engine_serves_after"] = still_serving(running)
                results[name] = outcome
    print(json.dumps({"benchmark": "attacks", "results": results}, indent=1))
    return 0 if all(r["engine_serves_after"] and str(r["status"]).startswith("4") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
