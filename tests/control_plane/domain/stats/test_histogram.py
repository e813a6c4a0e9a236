"""Percentiles from summed Prometheus histogram buckets (as PromQL's histogram_quantile)."""

from __future__ import annotations

import math

import pytest

from control_plane.domain.stats.histogram import TTFT, add, parse_buckets, quantile

TEXT = """# HELP loraplane_time_to_first_token_seconds x
# TYPE loraplane_time_to_first_token_seconds histogram
loraplane_time_to_first_token_seconds_bucket{adapter="a",le="0.1"} 2.0
loraplane_time_to_first_token_seconds_bucket{adapter="a",le="1.0"} 4.0
loraplane_time_to_first_token_seconds_bucket{adapter="a",le="+Inf"} 4.0
loraplane_time_to_first_token_seconds_count{adapter="a"} 4.0
loraplane_time_to_first_token_seconds_sum{adapter="a"} 1.5
"""


def test_parse_sum_and_interpolate() -> None:
    one = parse_buckets(TEXT)[TTFT]["a"]
    assert one == {0.1: 2.0, 1.0: 4.0, math.inf: 4.0}
    both: dict[float, float] = {}
    add(both, one)
    add(both, {0.1: 0.0, 1.0: 4.0, math.inf: 4.0})  # a second engine, all its samples in (0.1, 1]
    assert quantile(0.5, both) == pytest.approx(0.1 + 0.9 * (4 - 2) / (8 - 2))  # rank 4 of 8
    assert quantile(0.25, both) == 0.1  # the whole first bucket: rank 2 of 8
    assert quantile(0.99, {0.1: 0.0, math.inf: 3.0}) == 0.1  # overflow bucket: its lower bound
    assert quantile(0.5, {}) is None and quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None
