"""bench/structured.py run as a script on the demo model with its smallest settings: one engine process, the
JSON's shape, the compile cache's lookups it reports, and every constrained answer (written with
--answers) checked against its own schema by jsonschema."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[2]
REQUESTS = 2  # cold and warm single requests, each
ADAPTERS = 2  # mixed clients: one constrained, one not
GROUP_FIGURES = {"ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99"}


def test_the_smallest_run_reports_every_figure_and_only_valid_answers(tmp_path: Path) -> None:
    answers_file = tmp_path / "answers.jsonl"
    cmd = [sys.executable, str(REPO / "bench" / "structured.py"), "--demo", "--repeats", "1", "--requests",
           str(REQUESTS), "--adapters", str(ADAPTERS), "--requests-per-client", "1", "--output-len", "8",
           "--answers", str(answers_file)]
    done = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)  # one JSON object, nothing else on stdout

    assert out["benchmark"] == "structured" and out["cpu"] and out["cpus"] >= 1 and out["cpu_threads"] >= 1
    for kind in ("cold", "warm"):
        assert out["single"][kind]["n"] == REQUESTS
        ttft = out["single"][kind]["ttft_ms"]
        assert 0 < ttft["min"] <= ttft["median"] <= ttft["max"]
    assert set(out["single"]["cold_minus_warm_ms"]) == {"median", "min", "max"}
    mixed = out["mixed"]
    assert set(mixed) == {"plain", "mixed_warm", "mixed_cold"}
    assert set(mixed["plain"]) == {"unconstrained", "all"}
    assert set(mixed["plain"]["all"]) == GROUP_FIGURES | {"tokens_per_s", "decode_step_ms"}
    for variant in ("mixed_warm", "mixed_cold"):
        assert set(mixed[variant]) == {"constrained", "unconstrained", "all", "unconstrained_vs_plain", "all_vs_plain"}
        assert set(mixed[variant]["constrained"]) == set(mixed[variant]["unconstrained_vs_plain"]) == GROUP_FIGURES
        assert set(mixed[variant]["all_vs_plain"]) == GROUP_FIGURES | {"tokens_per_s", "decode_step_ms"}
        assert mixed[variant]["all"]["decode_step_ms"]["median"] > 0

    # each cold schema is new (a miss), each warm one found compiled (a hit); plain runs look nothing up
    assert out["cache"] == {"single_cold": {"hits": 0, "misses": REQUESTS}, "single_warm": {"hits": REQUESTS, "misses": 0},
                            "plain": {"hits": 0, "misses": 0}, "mixed_warm": {"hits": 1, "misses": 0},
                            "mixed_cold": {"hits": 0, "misses": 1}}

    answers = [json.loads(line) for line in answers_file.read_text().splitlines()]
    assert len(answers) == 1 + 2 * REQUESTS + 2  # the warm-up's, the single requests', one per mixed variant
    for answer in answers:
        assert answer["finish"] == "stop"
        jsonschema.validate(json.loads(answer["text"]), answer["schema"])
    assert len({json.dumps(a["schema"], sort_keys=True) for a in answers}) == 1 + REQUESTS + 1  # warm, and each cold
    assert out["answers"] == dict.fromkeys(("constrained", "finish_stop", "parsed", "valid"), len(answers))


def test_options_are_checked() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import structured  # bench/structured.py: a script, not a package
    finally:
        sys.path.remove(str(REPO / "bench"))
    args = structured.parse_args([])
    assert (args.repeats, args.requests, args.adapters, args.demo) == (3, 8, 32, False)
    for bad in (["--adapters", "1"], ["--repeats", "0"], ["--demo", "--model", "/m"]):
        with pytest.raises(SystemExit):
            structured.parse_args(bad)
