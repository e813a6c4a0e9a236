"""Per-tenant metrics of one router: requests by outcome, tokens by kind, 429s by limit.

`tenant` labels are capped like `model` labels (max_model_labels; later tenants fold into "other"), so a
fleet with many tenants never has unbounded series; requests of operators' static keys are "".
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry, max_labels: int) -> None:
        self._max = max_labels
        self._labels: set[str] = set()
        self.requests = Counter("loraplane_router_tenant_requests", "Requests of tenant keys by tenant and outcome "
                                "(ok, error, abort: the client left, rate_limited, not_found, unavailable, too_large: past "
                                "--max-request-tokens)", ["tenant", "outcome"],
                                registry=registry)
        self.tokens = Counter("loraplane_router_tenant_tokens", "Tokens used by tenant keys, by tenant and kind "
                              "(prompt, completion), as the engines counted them", ["tenant", "kind"], registry=registry)
        self.rate_limited = Counter("loraplane_router_tenant_rate_limited", "429 answers by tenant and limit "
                                    "(requests, tokens)", ["tenant", "limit"], registry=registry)
        self.quota_failures = Counter("loraplane_router_quota_store_failures", "Requests that found Redis "
                                      "unreachable, by what the router did (refused, admitted)", ["action"],
                                      registry=registry)

    def label(self, tenant: str) -> str:
        if tenant in self._labels:
            return tenant
        if len(self._labels) < self._max:
            self._labels.add(tenant)
            return tenant
        return "other"
