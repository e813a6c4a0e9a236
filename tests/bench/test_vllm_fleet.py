"""bench/vllm_fleet.py's own parts, without servers: a stream's timing, the alternation, the figures and
the JSON's shape, the options."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import vllm_fleet  # noqa: E402  (bench/vllm_fleet.py: a script, not a package)
from vllm_fleet import Timing  # noqa: E402


def test_a_streams_timing_is_from_its_start_to_its_first_token_and_its_end() -> None:
    assert vllm_fleet.stream_timing(10.0, [10.25, 10.5, 11.0], 11.5) == Timing(0.25, 1.5)
    with pytest.raises(ValueError, match="no token"):
        vllm_fleet.stream_timing(10.0, [], 11.0)


def test_the_two_paths_take_turns_going_first() -> None:
    orders = vllm_fleet.alternation(3, 2)
    assert orders == [("direct", "routed"), ("routed", "direct")] * 3


def test_overhead_gives_each_paths_median_and_range_and_the_ratio_pair_by_pair() -> None:
    pairs = [(Timing(0.1, 1.0), Timing(0.2, 1.1)), (Timing(0.2, 2.0), Timing(0.3, 2.0)),
             (Timing(0.4, 4.0), Timing(0.4, 5.0))]
    out = vllm_fleet.overhead(pairs)
    assert out["pairs"] == 3
    assert out["ttft_ms"]["direct"] == {"median": 200.0, "min": 100.0, "max": 400.0}
    assert out["ttft_ms"]["routed"] == {"median": 300.0, "min": 200.0, "max": 400.0}
    assert out["ttft_ms"]["ratio_routed_over_direct"] == {"median": 1.5, "min": 1.0, "max": 2.0}
    assert out["ttft_ms"]["routed_minus_direct_ms"] == 100.0
    assert out["total_ms"]["ratio_routed_over_direct"] == {"median": 1.1, "min": 1.0, "max": 1.25}


def test_report_shape() -> None:
    args = vllm_fleet.parse_args(["--cold", "2", "--requests", "1", "--model", "/m"])
    out = vllm_fleet.report(args, [(0.5, 0.75), (1.0, 1.5)], [(Timing(0.1, 1.0), Timing(0.1, 1.0))] * 3, "cpu")
    assert set(out) == {"bench", "vllm", "cpu", "model", "settings", "cold", "router_overhead"}
    assert out["cold"] == {"upload_ms": {"median": 750.0, "min": 500.0, "max": 1000.0},
                           "upload_to_first_token_ms": {"median": 1125.0, "min": 750.0, "max": 1500.0},
                           "runs_ms": [750.0, 1500.0]}
    assert out["settings"] == {"cold": 2, "repeats": 3, "requests": 1, "prompt_len": 128, "output_len": 32}


@pytest.mark.parametrize("argv", [["--repeats", "2"], ["--cold", "0"], ["--requests", "0"], ["--output-len", "0"]])
def test_options_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        vllm_fleet.parse_args(argv)
