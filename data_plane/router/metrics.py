"""Prometheus metrics of one router process, on a registry of its own.

`model` labels are bounded: the first `max_model_labels` names the table routes get their own value, later
ones fold into "other", and a name that routed nowhere is "" (client typos never become series).
`engine` is "" for answers the router gave itself (401, 404, 503 with no engine reachable).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
# ok: the engine answered < 400; error: it answered >= 400 or broke off; abort: the client went away;
# not_found / unavailable / rejected: the router answered itself (404, 503, 4xx of a bad request or key)
OUTCOMES = ("ok", "error", "abort", "not_found", "unavailable", "rejected")
# connect: refused or timed out connecting; disconnected: closed without an answer; unavailable: a 503
RETRY_REASONS = ("connect", "disconnected", "unavailable", "refused")
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self, max_model_labels: int, table_age_s: Callable[[], float | None],
                 outstanding: Callable[[], dict[str, int]]) -> None:
        self.registry = r = CollectorRegistry()
        self._max_model_labels = max_model_labels
        self._model_labels: set[str] = set()
        self.requests = Counter("loraplane_router_requests", "Requests by model, engine and outcome",
                                ["model", "engine", "outcome"], registry=r)
        self.affinity = Counter("loraplane_router_affinity", "Adapter requests routed to a device-resident "
                                "holder (hit) or not (miss)", ["result"], registry=r)
        self.prefix_affinity = Counter("loraplane_router_prefix_affinity", "Base-model requests routed to the "
                                       "engine that last served their prompt prefix (hit) or not (miss)",
                                       ["result"], registry=r)
        self.retries = Counter("loraplane_router_retries", "Requests sent to the next candidate before the "
                               "first byte, by reason", ["reason"], registry=r)
        self.ttft = Histogram("loraplane_router_upstream_ttft_seconds", "From sending a request to an engine "
                              "to the first byte of its answer", ["engine"], buckets=_TTFT_BUCKETS, registry=r)
        self.revalidations = Counter("loraplane_router_table_revalidations", "GET /v1/routes by result "
                                     "(changed, not_modified, failed)", ["result"], registry=r)
        self.placements = Counter("loraplane_router_placements", "Placement requests to the control plane "
                                  "by outcome (placed, unknown, failed)", ["outcome"], registry=r)
        self.demand_reports = Counter("loraplane_router_demand_reports", "Demand reports sent to the control "
                                      "plane by result (ok, failed)", ["result"], registry=r)
        age = Gauge("loraplane_router_routing_table_age_seconds", "Seconds since the control plane last "
                    "confirmed the routing table (-1 before the first)", registry=r)
        age.set_function(lambda: -1.0 if (a := table_age_s()) is None else a)
        r.register(_Outstanding(outstanding))
        for result in ("hit", "miss"):  # zeros from the first scrape, so rate() and ratios work at once
            self.affinity.labels(result)
            self.prefix_affinity.labels(result)
        for result in ("changed", "not_modified", "failed"):
            self.revalidations.labels(result)
        for result in ("ok", "failed"):
            self.demand_reports.labels(result)
        for reason in RETRY_REASONS:
            self.retries.labels(reason)

    def model_label(self, model: str) -> str:
        if model in self._model_labels:
            return model
        if len(self._model_labels) < self._max_model_labels:
            self._model_labels.add(model)
            return model
        return "other"

    def request(self, model: str, engine: str, outcome: str) -> None:
        self.requests.labels(self.model_label(model) if model else "", engine, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Outstanding:
    """Requests in flight per engine, read from the balancer at scrape time (never stale)."""

    def __init__(self, outstanding: Callable[[], dict[str, int]]) -> None:
        self._outstanding = outstanding

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("loraplane_router_outstanding_requests", "Requests in flight per engine",
                                   labels=["engine"])
        for engine, count in sorted(self._outstanding().items()):
            family.add_metric([engine], count)
        yield family
