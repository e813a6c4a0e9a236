"""The LoRA side of the Prometheus metrics: the capped `adapter` label and the per-adapter engine series.

The engine reports per adapter id (queues, slot, loads, evictions, load seconds) in `stats().lora`;
this module maps ids to names, names to label values, and turns the engine's per-id counters — which
disappear when an adapter is removed — into monotonic counters and a load-latency histogram.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from data_plane.adapters.stats import LoRAStatsSource
from data_plane.lora.slots import LoRAEngineStats

logger = logging.getLogger(__name__)

OTHER = "other"
UNRESOLVED = ""  # the request's model name did not resolve: it must not become a label value
_LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class AdapterLabels:
    """name -> label value: the base name and the first `cap` adapter names as themselves, then "other".

    A name keeps its value for the life of the process (unload and reload do not free a place), so
    the number of series is bounded by cap + 2 whatever the adapter churn.
    """

    def __init__(self, base_name: str | None, cap: int) -> None:
        self.base_name = base_name
        self.cap = max(0, cap)
        self._own: set[str] = set()

    def __call__(self, name: str | None) -> str:
        if name is None:
            return UNRESOLVED
        if name == self.base_name or name in self._own:
            return name
        if len(self._own) < self.cap:
            self._own.add(name)
            return name
        return OTHER


class LoRAMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        stats: Callable[[], LoRAStatsSource],
        adapter_names: Callable[[int], str | None],
        labels: AdapterLabels,
    ) -> None:
        self._stats = stats
        self._names = adapter_names
        self._labels = labels
        self.loads = Counter(
            "loraplane_lora_loads", "Adapter copies into a device slot", ["adapter"], registry=registry
        )
        self.evictions = Counter(
            "loraplane_lora_evictions", "Adapters evicted from a device slot", ["adapter"], registry=registry
        )
        self.load_seconds = Histogram(
            "loraplane_lora_load_seconds",
            "Time to copy an adapter into a device slot",
            ["adapter"],
            buckets=_LOAD_BUCKETS,
            registry=registry,
        )
        # adapter id -> (label, loads, evictions, load_seconds_total) at the last sync
        self._last: dict[int, tuple[str, int, int, float]] = {}
        registry.register(_LoRAGaugeCollector(self))

    def lora_stats(self) -> LoRAEngineStats | None:
        """The engine's LoRA figures; None when reading them failed (the scrape goes on without them)."""
        try:
            return self._stats().lora
        except Exception:
            logger.exception("engine.stats() failed during a metrics scrape")
            return None

    def label_of(self, adapter_id: int) -> str:
        last = self._last.get(adapter_id)
        if last is not None:
            return last[0]
        name = self._names(adapter_id)
        return self._labels(name) if name is not None else OTHER  # gone from the registry already

    def sync(self) -> None:
        """Add what the engine counted since the last scrape (each id's counters only grow)."""
        lora = self.lora_stats()
        if lora is None:
            return
        seen: dict[int, tuple[str, int, int, float]] = {}
        for adapter_id, a in lora.adapters.items():
            label = self.label_of(adapter_id)
            _, loads0, evictions0, seconds0 = self._last.get(adapter_id, (label, 0, 0, 0.0))
            new_loads = a.loads - loads0
            if new_loads > 0:
                self.loads.labels(label).inc(new_loads)
                spent = a.load_seconds_total - seconds0
                if new_loads == 1 and a.last_load_seconds is not None:
                    self.load_seconds.labels(label).observe(a.last_load_seconds)
                else:  # several loads between scrapes: only their total is known, spread it evenly
                    for _ in range(new_loads):
                        self.load_seconds.labels(label).observe(max(0.0, spent / new_loads))
            if a.evictions > evictions0:
                self.evictions.labels(label).inc(a.evictions - evictions0)
            seen[adapter_id] = (label, a.loads, a.evictions, a.load_seconds_total)
        self._last = seen  # ids the engine dropped are forgotten


class _LoRAGaugeCollector:
    """Scrape-time gauges: slot occupancy, each adapter's running / waiting sequences and its residency."""

    def __init__(self, metrics: LoRAMetrics) -> None:
        self._m = metrics

    def describe(self) -> list[Metric]:
        return []  # do not call the engine when registered

    def collect(self) -> Iterator[Metric]:
        lora = self._m.lora_stats()
        if lora is None:
            return
        yield GaugeMetricFamily("loraplane_lora_slots_used", "Device slots holding an adapter", value=lora.slots_used)
        yield GaugeMetricFamily("loraplane_lora_slots_total", "Device slots for adapters", value=lora.slots_total)
        running = GaugeMetricFamily(
            "loraplane_lora_running_sequences", "Running sequences per adapter", labels=["adapter"]
        )
        waiting = GaugeMetricFamily(
            "loraplane_lora_waiting_sequences", "Waiting sequences per adapter", labels=["adapter"]
        )
        resident = GaugeMetricFamily(
            "loraplane_lora_device_resident", "Adapters in a device slot (0: held in host memory only)",
            labels=["adapter"],
        )
        by_label: dict[str, list[int]] = {}
        for adapter_id, a in lora.adapters.items():
            counts = by_label.setdefault(self._m.label_of(adapter_id), [0, 0, 0])
            counts[0] += a.running
            counts[1] += a.waiting
            counts[2] += a.slot is not None
        for label, (r, w, d) in sorted(by_label.items()):
            running.add_metric([label], r)
            waiting.add_metric([label], w)
            resident.add_metric([label], d)
        yield running
        yield waiting
        yield resident
