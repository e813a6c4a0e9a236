"""What bounds the router's per-tenant state: the refused keys it remembers (keys.Misses) and the tenant
labels of its metrics (tenant_metrics.TenantMetrics), each capped whatever clients send."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from data_plane.router.keys import Misses
from data_plane.router.tenant_metrics import TenantMetrics
from shared.errors import AuthenticationError


def test_misses_keep_the_newest_within_their_size_and_ttl() -> None:
    misses = Misses(2, ttl_s=60.0)
    for key in (b"a", b"b", b"c"):
        assert isinstance(misses.put(key, f"refused {key!r}"), AuthenticationError)
    assert len(misses) == 2 and misses.get(b"a") is None  # the oldest went first
    error = misses.get(b"c")
    assert error is not None and error.status_code == 401 and "refused b'c'" in str(error)
    assert misses.get(b"c") is not error  # a fresh error each time (a raised one would keep its frames)
    lapsed = Misses(2, ttl_s=0.0)
    lapsed.put(b"a", "refused")
    assert lapsed.get(b"a") is None and len(lapsed) == 0


def test_tenant_labels_fold_into_other_past_the_cap() -> None:
    registry = CollectorRegistry()
    metrics = TenantMetrics(registry, max_labels=2)
    labels = [metrics.label(t) for t in ("a", "b", "c", "a", "d")]
    assert labels == ["a", "b", "other", "a", "other"]
    for label in labels:
        metrics.requests.labels(label, "ok").inc()
    assert registry.get_sample_value("loraplane_router_tenant_requests_total", {"tenant": "other", "outcome": "ok"}) == 2
    tenants = {s.labels["tenant"] for m in registry.collect() for s in m.samples if "tenant" in s.labels}
    assert tenants == {"a", "b", "other"}
