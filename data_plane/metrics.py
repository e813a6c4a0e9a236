"""Prometheus metrics of one engine process, on a registry owned by the app (not the global one).

Per-request figures (outcome, tokens, latencies) are recorded by the serving layer through a
`RequestMetrics` created per engine request, labelled by `adapter`: the resolved model name (the
base model's served name for base requests; "" when the name did not resolve, so client typos never
become label values). Only the first `max_adapter_labels` adapter names get their own value; later
ones fold into "other", which bounds the series count however many adapters come and go.

Engine-wide figures (queues, KV blocks, prefix cache, LoRA slots and per-adapter queues) are read
from `engine.stats()` at scrape time by a custom collector, so they are never stale. The engine's
per-adapter load/eviction counters vanish when an adapter is removed, so they are turned into
monotonic Prometheus counters (and a load-latency histogram) by diffing at each scrape.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from data_plane.adapters.metrics import AdapterLabels, LoRAMetrics
from data_plane.adapters.stats import AdapterRequestStats, LoRAStatsSource

logger = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST
OUTCOMES = ("ok", "error", "abort", "rejected")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_STEP_ADAPTER_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)  # distinct adapters in one step
_FIRST_TOKEN_STEP_BUCKETS = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # engine steps
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class EngineStatsLike(LoRAStatsSource, Protocol):
    """data_plane.engine.llm_engine.EngineStats, as far as the metrics read it."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    step_adapters: dict[int, int]  # steps by number of distinct adapters in them


class EngineMetrics:
    def __init__(
        self,
        stats: Callable[[], EngineStatsLike] | None = None,
        *,
        base_name: str | None = None,
        max_adapter_labels: int = 100,
        adapter_names: Callable[[int], str | None] | None = None,  # adapter id -> name (LoRA on)
        request_stats: AdapterRequestStats | None = None,  # per-adapter figures for /v1/lora_stats
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.labels = AdapterLabels(base_name, max_adapter_labels)
        self.request_stats = request_stats
        self.requests = Counter(
            "loraplane_requests", "Finished engine requests by adapter and outcome", ["adapter", "outcome"], registry=r
        )
        if base_name is not None:
            for outcome in OUTCOMES:  # export zeros so rate() and alerts work from the first scrape
                self.requests.labels(base_name, outcome)
        self.prompt_tokens = Counter(
            "loraplane_prompt_tokens", "Prompt tokens of admitted requests", ["adapter"], registry=r
        )
        self.generation_tokens = Counter("loraplane_generation_tokens", "Generated tokens", ["adapter"], registry=r)
        self.ttft = Histogram(
            "loraplane_time_to_first_token_seconds",
            "From the HTTP request to the first generated token",
            ["adapter"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_steps = Histogram(
            "loraplane_time_to_first_token_steps",
            "Engine steps from a request's arrival in the engine through the one that sampled its first token "
            "(1: admitted at the next step); the scheduler's fair share bounds it for a request that arrives "
            "beside one that fills the batch",
            ["adapter"],
            buckets=_FIRST_TOKEN_STEP_BUCKETS,
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
            ["adapter"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.lora: LoRAMetrics | None = None
        if stats is not None:
            r.register(_EngineStatsCollector(stats))
            if adapter_names is not None:
                self.lora = LoRAMetrics(r, stats, adapter_names, self.labels)

    def start_request(self, arrival: float | None = None, adapter: str | None = None) -> RequestMetrics:
        """arrival: time.monotonic() when the HTTP request came in (TTFT counts tokenization).
        adapter: the *resolved* model name (None while the name is not known to be served)."""
        return RequestMetrics(self, time.monotonic() if arrival is None else arrival, adapter)

    def render(self) -> bytes:
        if self.lora is not None:
            self.lora.sync()  # engine counters -> monotonic Prometheus counters, before they are read
        return generate_latest(self.registry)


class RequestMetrics:
    """Timings and token counts of one engine request, reported once when it ends."""

    def __init__(self, metrics: EngineMetrics, arrival: float, adapter: str | None) -> None:
        self._m = metrics
        self.arrival = arrival
        self.adapter = adapter
        self.label = metrics.labels(adapter)  # fixed at the start: a name keeps its label value
        # the per-token series, looked up at the first token (labels() validates and locks on every call;
        # not before, so that a request refused before any token adds no series)
        self._generation_tokens: Counter | None = None
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.outcome: str | None = None

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self._m.prompt_tokens.labels(self.label).inc(prompt_tokens)

    def on_output(self, num_new_tokens: int, first_token_steps: int | None = None, now: float | None = None) -> None:
        """Called for every engine output; one output carries the tokens of one step (all choices), the
        first one with tokens the engine steps it took (RequestOutput.first_token_steps)."""
        if first_token_steps is not None:
            self._m.ttft_steps.labels(self.label).observe(first_token_steps)
        if num_new_tokens <= 0:
            return
        now = time.monotonic() if now is None else now
        if self.first_token_time is None:
            self.first_token_time = now
            self._m.ttft.labels(self.label).observe(now - self.arrival)
            self._generation_tokens = self._m.generation_tokens.labels(self.label)
        else:
            assert self.last_token_time is not None  # set with the first token
            self._m.itl.observe(now - self.last_token_time)
        self.last_token_time = now
        self.generation_tokens += num_new_tokens
        assert self._generation_tokens is not None  # set with the first token above
        self._generation_tokens.inc(num_new_tokens)
        if self._m.request_stats is not None and self.adapter is not None:
            self._m.request_stats.record_tokens(self.adapter, num_new_tokens, now)

    def finish(self, outcome: str) -> None:
        """Count the request once, whatever path ends it (later calls are ignored)."""
        if self.outcome is not None:
            return
        assert outcome in OUTCOMES, outcome
        self.outcome = outcome
        self._m.requests.labels(self.label, outcome).inc()
        e2e = None
        if outcome != "rejected":
            e2e = time.monotonic() - self.arrival
            self._m.e2e.labels(self.label).observe(e2e)
        if self._m.request_stats is not None and self.adapter is not None:
            ttft = None if self.first_token_time is None else self.first_token_time - self.arrival
            self._m.request_stats.record_finish(
                self.adapter, outcome, self.prompt_tokens, self.generation_tokens, ttft, e2e
            )


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
        yield CounterMetricFamily(
            "loraplane_num_preemptions",  # vLLM: vllm:num_preemptions_total
            "Running sequences preempted (KV blocks freed, recomputed later) because the KV cache was full",
            value=s.num_preemptions,
        )
        yield _step_adapters_histogram(s.step_adapters)


class GrammarCacheLike(Protocol):
    """data_plane.structured.compiler.GrammarCompiler, as far as the metrics read it."""

    hits: int
    misses: int


class GrammarCacheCollector:
    """The structured-output compile cache's lookups, read at scrape time."""

    def __init__(self, cache: GrammarCacheLike) -> None:
        self._cache = cache

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "loraplane_structured_output_cache_hits",
            "Structured-output constraints found compiled in the API process's cache",
            value=self._cache.hits,
        )
        yield CounterMetricFamily(
            "loraplane_structured_output_cache_misses",
            "Structured-output constraints compiled because the API process's cache did not hold them",
            value=self._cache.misses,
        )


def _step_adapters_histogram(steps_by_count: dict[int, int]) -> HistogramMetricFamily:
    """How many distinct LoRA adapters each engine step ran, from the engine's per-step counts."""
    buckets = [(str(le), sum(n for k, n in steps_by_count.items() if k <= le)) for le in _STEP_ADAPTER_BUCKETS]
    buckets.append(("+Inf", sum(steps_by_count.values())))
    return HistogramMetricFamily(
        "loraplane_step_adapters",
        "Distinct LoRA adapters in one engine step (the base model not counted)",
        buckets=buckets,
        sum_value=sum(k * n for k, n in steps_by_count.items()),
    )
