"""What bounds the router's per-tenant state: the refused keys it remembers (keys.Misses), the failed key
attempts it counts (shared/key_checks.py) and the tenant labels of its metrics (tenant_metrics.TenantMetrics),
each capped whatever clients send."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from data_plane.router.keys import Misses
from data_plane.router.tenant_metrics import TenantMetrics
from shared.errors import AuthenticationError
from shared.key_checks import InvalidKeyError, KeyChecks


def test_misses_keep_the_newest_within_their_size_and_ttl() -> None:
    misses = Misses(2, ttl_s=60.0)
    for key in ("a", "b", "c"):
        assert isinstance(misses.put(key, f"refused {key}", unknown=key != "b"), AuthenticationError)
    assert len(misses) == 2 and misses.get("a") is None  # the oldest went first
    error = misses.get("c")
    assert error is not None and error.status_code == 401 and "refused c" in str(error)
    assert misses.get("c") is not error  # a fresh error each time (a raised one would keep its frames)
    # an unknown key id is a failed attempt (counted); a revoked key is not a guess
    assert isinstance(error, InvalidKeyError) and not isinstance(misses.get("b"), InvalidKeyError)
    lapsed = Misses(2, ttl_s=0.0)
    lapsed.put("a", "refused", unknown=True)
    assert lapsed.get("a") is None and len(lapsed) == 0


def test_failed_attempts_are_counted_in_bounded_tables() -> None:
    checks = KeyChecks(per_address=1, per_key=1000, window_s=60.0, max_tracked=2)
    for host in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
        with pytest.raises(InvalidKeyError), checks.attempt(f"key-{host}", host):
            raise InvalidKeyError("wrong")
    assert checks.refusal("x", "10.0.0.1") is None  # forgotten: the oldest of three in a table of two
    assert checks.refusal("x", "10.0.0.3") is not None
    # an IPv6 client is counted by its /64
    with pytest.raises(InvalidKeyError), checks.attempt("k", "2001:db8::1"):
        raise InvalidKeyError("wrong")
    assert checks.refusal("x", "2001:db8::ffff:1") is not None and checks.refusal("x", "2001:db8:0:1::1") is None


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
