"""Prometheus metrics of the control plane, on a registry of its own (several apps in one test process
must not share counters, and nothing else's metrics should leak into /metrics)."""

from __future__ import annotations

import time

from litestar.types import ASGIApp, Message, Receive, Scope, Send
from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "ControlPlaneMetrics"]


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

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def middleware(self, app: ASGIApp) -> ASGIApp:
        """Counts every HTTP response by its route template (not the raw path: names are unbounded)."""

        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            start, status = time.perf_counter(), 500

            async def capture(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            try:
                await app(scope, receive, send=capture)
            finally:
                route = scope.get("path_template") or "unmatched"
                self.requests.labels(scope["method"], route, str(status)).inc()
                self.latency.labels(scope["method"], route).observe(time.perf_counter() - start)

        return wrapped
