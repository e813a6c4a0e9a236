"""bench/peer.py's own parts, without servers: percentiles, options, the JSON's shape, and that it reads the
engine core's step timer as the engine writes it."""

import logging
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from data_plane.config import EngineConfig
from data_plane.demo.model_builder import write_demo_model
from data_plane.engine.llm_engine import STEP_LOGGER, LLMEngine
from data_plane.engine.sampling_params import SamplingParams
from data_plane.engine.sequence import Request

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import peer  # noqa: E402  (bench/peer.py: a script, not a package)


def test_percentiles_match_numpy() -> None:
    rng = random.Random(1)
    for n in (1, 2, 7, 100, 1001):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 50, 99, 100):
            assert peer.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_options() -> None:
    args = peer.parse_args([])
    assert args.shapes == ["chat", "long", "lora32", "lora128"] and args.engines == ["loraplane", "vllm"]
    assert args.repeats == 3
    args = peer.parse_args(["--shapes", "lora32", "chat", "--engines", "loraplane", "--repeats", "1"])
    assert args.shapes == ["chat", "lora32"] and args.engines == ["loraplane"]  # chat first: its steps are timed
    with pytest.raises(SystemExit):
        peer.parse_args(["--shapes", "nope"])


def test_report_shape_and_ratios() -> None:
    def figures(tok_s: float) -> dict[str, float]:
        return {"tokens_per_s": tok_s, "ttft_ms_p50": 1.0, "ttft_ms_p99": 2.0, "itl_ms_p50": 3.0, "itl_ms_p99": 4.0}

    runs = {"chat": {"loraplane": [figures(100), figures(90), figures(120)], "vllm": [figures(50), figures(60), figures(40)]},
            "lora32": {"loraplane": [figures(80), figures(81), figures(96)], "vllm": [figures(10), figures(12), figures(8)]}}
    out = peer.report(peer.parse_args(["--shapes", "chat", "lora32"]), runs, [20.0, 25.0, 30.0], [50.0, 60.0], "cpu")
    chat = out["shapes"]["chat"]
    assert chat["ratio_loraplane_over_vllm"] == {"median": 2.0, "min": 1.5, "max": 3.0}  # paired by repeat
    assert chat["vllm"]["tokens_per_s"] == {"median": 50, "min": 40, "max": 60}
    assert set(chat["loraplane"]) == {"tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99"}
    assert out["shapes"]["lora32"]["loraplane_over_own_base"]["median"] == 0.8
    assert (out["linear_floor_ms"], out["decode_step_ms"], out["decode_step_over_floor"]) == (25.0, 55.0, 2.2)


def test_reads_the_engines_step_timer(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_demo_model(tmp_path, seed=0)
    engine = LLMEngine.from_config(EngineConfig(model=str(tmp_path), device="cpu", max_num_seqs=4,
                                                engine_core_process=False))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i in range(3):
        engine.add_request(Request(f"r{i}", [10 + i] * 8, params))
    with caplog.at_level(logging.DEBUG, logger=STEP_LOGGER):
        while engine.has_work():
            engine.step()
    times = peer.decode_step_times(caplog.text, 3)
    assert len(times) == 5 and all(t > 0 for t in times)  # one prefill step samples the first token of each
    assert peer.decode_step_times(caplog.text, 4) == []
