"""Prometheus figures of the adapter reader processes, read at scrape time.

A load that meets running requests and is read on a thread of the API process (no reader ready yet,
or the busy readers' wait ran out) is what slows the streams' tokens (reader_process.py), so that
count is the one to watch: `loraplane_adapter_reads_total{where="api_thread",serving="true"}`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from data_plane.adapters.loading.reader_process import AdapterReaderProcess


class AdapterReaderCollector(Collector):
    def __init__(self, readers: AdapterReaderProcess) -> None:
        self._readers = readers

    def collect(self) -> Iterator[Metric]:
        processes = GaugeMetricFamily("loraplane_adapter_reader_processes",
                                      "Adapter reader processes by state (starting: importing torch)", labels=["state"])
        for state, count in self._readers.states().items():
            processes.add_metric([state], count)
        yield processes
        reads = CounterMetricFamily("loraplane_adapter_reads",
                                    "Adapter loads read from files, by where (reader_process, api_thread) and whether "
                                    "the engine was serving requests", labels=["where", "serving"])
        for where in ("reader_process", "api_thread"):
            for serving in (False, True):
                reads.add_metric([where, str(serving).lower()], self._readers.reads[(where, serving)])
        yield reads
