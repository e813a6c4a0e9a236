"""Prometheus figures of the artifact cache, read from its counters at scrape time (never stale)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from data_plane.adapters.artifacts.cache import ArtifactCache


class ArtifactCollector(Collector):
    def __init__(self, cache: ArtifactCache) -> None:
        self._cache = cache

    def collect(self) -> Iterator[Metric]:
        s = self._cache.stats
        fetches = CounterMetricFamily("loraplane_artifact_fetches", "Adapter versions fetched by digest, by outcome",
                                      labels=["outcome"])
        fetches.add_metric(["ok"], s.fetches)
        fetches.add_metric(["error"], s.fetch_failures)
        yield fetches
        yield CounterMetricFamily("loraplane_artifact_cache_write_failures",
                                  "Versions fetched and verified whose cache copy could not be written (fetched again "
                                  "next time)", value=s.write_failures)
        yield CounterMetricFamily("loraplane_artifact_fetch_bytes", "Artifact bytes received (verified or not)",
                                  value=s.fetched_bytes)
        yield CounterMetricFamily("loraplane_artifact_cache_hits", "Artifact needs met by the cache, no request made",
                                  value=s.hits)
        yield CounterMetricFamily("loraplane_artifact_cache_misses", "Artifact needs that fetched", value=s.misses)
        yield CounterMetricFamily("loraplane_artifact_cache_evictions", "Versions evicted from the artifact cache",
                                  value=s.evictions)
        yield CounterMetricFamily("loraplane_artifact_paced_seconds",
                                  "Seconds downloads and cache writes rested because the engine was serving "
                                  "(they use at most a quarter of a CPU then)", value=self._cache.fetcher.pace.rested_s)
        yield GaugeMetricFamily("loraplane_artifact_cache_bytes", "Bytes of verified versions in the artifact cache",
                                value=self._cache.size_bytes)
        yield GaugeMetricFamily("loraplane_artifact_cache_capacity_bytes", "--lora-cache-max-bytes",
                                value=self._cache.max_bytes)
