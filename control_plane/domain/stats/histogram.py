"""Latency percentiles across engines from their Prometheus histograms (exact bucket sums, then the
same linear interpolation inside a bucket as PromQL's histogram_quantile)."""

from __future__ import annotations

import math
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

TTFT = "loraplane_time_to_first_token_seconds"
E2E = "loraplane_e2e_request_latency_seconds"

# metric -> adapter -> upper bound -> cumulative count
Buckets = dict[str, dict[str, dict[float, float]]]


def empty(metrics: tuple[str, ...] = (TTFT, E2E)) -> Buckets:
    return {m: defaultdict(dict) for m in metrics}


def parse_buckets(text: str, metrics: tuple[str, ...] = (TTFT, E2E)) -> Buckets:
    """The adapters' buckets of `metrics`; raises (ValueError or others of the parser) on malformed text."""
    out = empty(metrics)
    for family in text_string_to_metric_families(text):
        if family.name not in out:
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket") and "adapter" in sample.labels:
                out[family.name][sample.labels["adapter"]][float(sample.labels["le"])] = sample.value
    return out


def add(into: dict[float, float], other: dict[float, float]) -> None:
    for bound, count in other.items():
        into[bound] = into.get(bound, 0.0) + count


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """histogram_quantile(q) over cumulative `buckets` (upper bound -> count); None without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] == 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower  # the top finite bound: nothing better to say about the overflow bucket
            return lower + (bound - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = bound, count
    return lower
