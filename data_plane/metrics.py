"""Prometheus metrics of one engine process, on a registry owned by the app (not the global one).

Per-request figures (outcome, tokens, latencies) are recorded by the serving layer through a
`RequestMetrics` created per engine request; engine-wide figures (queues, KV blocks, prefix cache)
are read from `engine.stats()` at scrape time by a custom collector, so they are never stale.

Multi-LoRA seam: `RequestMetrics` already carries the adapter name; adding an `adapter` label means
adding it to the per-request metrics' label names and passing `self.adapter` where RequestMetrics
records them, nothing else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

logger = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST
OUTCOMES = ("ok", "error", "abort", "rejected")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class EngineStatsLike(Protocol):
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int


class EngineMetrics:
    def __init__(self, stats: Callable[[], EngineStatsLike] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "loraplane_requests", "Finished engine requests by outcome", ["outcome"], registry=r
        )
        for outcome in OUTCOMES:  # export zeros so rate() and alerts work from the first scrape
            self.requests.labels(outcome)
        self.prompt_tokens = Counter(
            "loraplane_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter("loraplane_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(
            "loraplane_time_to_first_token_seconds",
            "From the HTTP request to the first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "loraplane_inter_token_latency_seconds",
            "Gap between consecutive engine outputs of one request",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "loraplane_e2e_request_latency_seconds",
            "From the HTTP request to the request's end (any outcome but rejected)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        if stats is not None:
            r.register(_EngineStatsCollector(stats))

    def start_request(self, arrival: float | None = None, adapter: str | None = None) -> RequestMetrics:
        """arrival: time.monotonic() when the HTTP request came in (TTFT counts tokenization)."""
        return RequestMetrics(self, time.monotonic() if arrival is None else arrival, adapter)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestMetrics:
    """Timings and token counts of one engine request, reported once when it ends."""

    def __init__(self, metrics: EngineMetrics, arrival: float, adapter: str | None) -> None:
        self._m = metrics
        self.arrival = arrival
        self.adapter = adapter  # multi-LoRA: becomes the `adapter` label
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.outcome: str | None = None

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self._m.prompt_tokens.inc(prompt_tokens)

    def on_output(self, num_new_tokens: int, now: float | None = None) -> None:
        """Called for every engine output; one output carries the tokens of one step (all choices)."""
        if num_new_tokens <= 0:
            return
        now = time.monotonic() if now is None else now
        if self.first_token_time is None:
            self.first_token_time = now
            self._m.ttft.observe(now - self.arrival)
        else:
            self._m.itl.observe(now - self.last_token_time)
        self.last_token_time = now
        self.generation_tokens += num_new_tokens
        self._m.generation_tokens.inc(num_new_tokens)

    def finish(self, outcome: str) -> None:
        """Count the request once, whatever path ends it (later calls are ignored)."""
        if self.outcome is not None:
            return
        assert outcome in OUTCOMES, outcome
        self.outcome = outcome
        self._m.requests.labels(outcome).inc()
        if outcome != "rejected":
            self._m.e2e.observe(time.monotonic() - self.arrival)


class _EngineStatsCollector:
    """Reads the engine's counters at scrape time; a failing engine drops these series, not the scrape."""

    def __init__(self, stats: Callable[[], EngineStatsLike]) -> None:
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []  # unchecked: do not call the engine when the collector is registered

    def collect(self) -> Iterator[Metric]:
        try:
            s = self._stats()
        except Exception:
            logger.exception("engine.stats() failed during a metrics scrape")
            return
        yield GaugeMetricFamily(
            "loraplane_running_sequences", "Sequences in the running queue", value=s.num_running
        )
        yield GaugeMetricFamily(
            "loraplane_waiting_sequences", "Sequences in the waiting queue", value=s.num_waiting
        )
        yield GaugeMetricFamily("loraplane_kv_blocks_used", "KV cache blocks in use", value=s.kv_blocks_used)
        yield GaugeMetricFamily(
            "loraplane_kv_blocks_total", "KV cache blocks in the pool", value=s.kv_blocks_total
        )
        yield CounterMetricFamily(
            "loraplane_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache",
            value=s.prefix_cache_queried_tokens,
        )
        yield CounterMetricFamily(
            "loraplane_prefix_cache_hit_tokens",
            "Prompt tokens found in the prefix cache",
            value=s.prefix_cache_hit_tokens,
        )
