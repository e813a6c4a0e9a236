"""Prometheus metrics of the control plane, on a registry of its own (several apps in one test process
must not share counters, and nothing else's metrics should leak into /metrics)."""

from __future__ import annotations

import time

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "ControlPlaneMetrics"]

ENGINE_CALL_SOURCES = ("push", "reconcile")  # an admin call's push, or a reconcile round
# converged: the engine held what was desired; changed: the round loaded or unloaded; failed: an engine call
# of the round failed; skipped: the engine was unreachable, locked by another replica or too slow
RECONCILE_RESULTS = ("converged", "changed", "failed", "skipped")


class ControlPlaneMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("loraplane_control_requests_total", "Admin API requests by route and status",
                                ["method", "route", "status"], registry=self.registry)
        self.latency = Histogram("loraplane_control_request_seconds", "Admin API request latency",
                                 ["method", "route"], registry=self.registry)
        self.mutations = Counter("loraplane_control_mutations_total", "Mutating calls by action and outcome",
                                 ["action", "outcome"], registry=self.registry)
        # with loraplane_control_requests_total{route="/v1/artifacts/{digest}/{name}"}: what engines fetched
        self.artifact_bytes = Counter("loraplane_control_artifact_bytes_total",
                                      "Bytes of adapter files streamed to engines from the artifact store",
                                      registry=self.registry)
        self.store_orphans_removed = Counter("loraplane_control_store_orphans_removed_total",
                                             "Artifact store objects removed because no version named them past "
                                             "the grace period (an upload killed before its commit)",
                                             registry=self.registry)
        self.engine_calls = Counter("loraplane_control_engine_calls_total", "Load and unload calls to engines "
                                    "by source (push, reconcile), action and outcome (ok, failed)",
                                    ["source", "action", "outcome"], registry=self.registry)
        self.reconcile_rounds = Counter("loraplane_control_reconcile_rounds_total", "Reconcile rounds of one "
                                        "engine by result (converged, changed, failed, skipped)", ["result"],
                                        registry=self.registry)
        # a fleet that converges reads 0 between changes; non-zero round after round means rounds do not fix it
        self.drift = Gauge("loraplane_control_reconcile_drift", "Placements the last reconcile round of each "
                           "engine found out of step with their desired state (to load, unload, or failed)",
                           ["engine"], registry=self.registry)
        for source in ENGINE_CALL_SOURCES:  # zeros from the first scrape, so rate() and ratios work at once
            for action in ("load", "unload"):
                for outcome in ("ok", "failed"):
                    self.engine_calls.labels(source, action, outcome)
        for result in RECONCILE_RESULTS:
            self.reconcile_rounds.labels(result)

    def engine_call(self, source: str, action: str, ok: bool) -> None:
        self.engine_calls.labels(source, action, "ok" if ok else "failed").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def middleware(self, app: ASGIApp) -> ASGIApp:
        """Counts every HTTP response by its route template (not the raw path: names are unbounded)."""

        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != ScopeType.HTTP:  # a str enum: equal to the scope's "http"
                await app(scope, receive, send)
                return
            start, status = time.perf_counter(), 500

            async def capture(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            try:
                await app(scope, receive, capture)
            finally:
                route = scope.get("path_template") or "unmatched"
                self.requests.labels(scope["method"], route, str(status)).inc()
                self.latency.labels(scope["method"], route).observe(time.perf_counter() - start)

        return wrapped
