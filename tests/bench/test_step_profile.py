"""bench/step_profile.py on the demo model: one JSON object whose phases name the operators that took the
time, the linear layers among them, with shares that add up to at most the whole."""

import json
import subprocess
import sys
from pathlib import Path

from data_plane.demo.model_builder import write_demo_model

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "step_profile.py"


def test_the_report_names_the_operators_of_each_phase(tmp_path: Path) -> None:
    write_demo_model(tmp_path, seed=0)
    out = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tmp_path), "--dtype", "float32", "--batch", "3",
                          "--warmup", "2", "--steps", "3", "--prompt-len", "40", "--top", "5"],
                         capture_output=True, text=True, check=True, timeout=300)
    report = json.loads(out.stdout)
    assert report["decode"]["batch"] == 3 and report["decode"]["steps"] == 3 and report["decode"]["step_ms"] > 0
    assert report["prefill"]["prompt_len"] == 40 and report["prefill"]["tokens_per_s"] > 0
    for phase in ("decode", "prefill"):
        top = report[phase]["top"]
        assert 0 < len(top) <= 5 and 0 < sum(op["share"] for op in top) <= 1.001
        assert [op["ms_per_step"] for op in top] == sorted((op["ms_per_step"] for op in top), reverse=True)
        assert any("linear" in op["op"] or "addmm" in op["op"] or "mm" in op["op"] for op in top)
