"""Writes the Grafana dashboards under deploy/grafana/dashboards/ from the panel lists below.

    python deploy/grafana/generate.py           # rewrite the JSON files
    python deploy/grafana/generate.py --check   # exit 1 when a committed file differs from this code

The JSON files are what Grafana (or a kustomize ConfigMap generator) reads; this module is where they are
edited. No dashboard SDK: grafana-foundation-sdk is not on PyPI's index here, and a dashboard is a small,
stable JSON document. Every expression names the scrape jobs of deploy/prometheus/scrape.yaml and the
metrics of control_plane/metrics.py, data_plane/metrics.py, data_plane/adapters/metrics.py and
data_plane/router/metrics.py; tests/deploy/test_dashboards.py evaluates each against a real Prometheus.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

OUT = Path(__file__).parent / "dashboards"
ENGINE_JOB, CONTROL_JOB, ROUTER_JOB = "loraplane-engine", "loraplane-control-plane", "loraplane-router"
RATE = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

E = f'job="{ENGINE_JOB}",instance=~"$instance"'  # an engine series of the chosen engines
A = f'{E},adapter=~"$adapter"'  # ... of the chosen adapters
C = f'job="{CONTROL_JOB}",instance=~"$instance"'
R = f'job="{ROUTER_JOB}",instance=~"$instance"'


def rate(metric: str, selector: str, by: str) -> str:
    return f"sum by ({by}) (rate({metric}{{{selector}}}[{RATE}]))"


def quantile(q: float, histogram: str, selector: str, by: str) -> str:
    return f"histogram_quantile({q}, {rate(histogram + '_bucket', selector, 'le, ' + by)})"


def quantiles(histogram: str, selector: str, by: str, legend: str) -> list[tuple[str, str]]:
    return [(quantile(q, histogram, selector, by), f"p{round(q * 100)} {legend}") for q in (0.5, 0.99)]


def ratio(numerator: str, denominator: str) -> str:
    """numerator / denominator, where a numerator that has no series yet (no error so far) reads as 0."""
    return f"({numerator} or {denominator} * 0) / {denominator}"


@dataclass(frozen=True)
class Panel:
    title: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | table (an instant top-N)
    description: str = ""


@dataclass(frozen=True)
class Variable:
    name: str
    query: str  # label_values(selector, label), or the options of a custom variable, comma-separated
    custom: bool = False

    def json(self) -> dict:
        if self.custom:
            options = self.query.split(",")
            return {"name": self.name, "type": "custom", "query": self.query,
                    "current": {"text": options[0], "value": options[0]},
                    "options": [{"text": o, "value": o, "selected": o == options[0]} for o in options]}
        return {"name": self.name, "type": "query", "datasource": DATASOURCE, "refresh": 2, "sort": 1,
                "query": {"query": self.query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
                "definition": self.query, "multi": True, "includeAll": True, "allValue": ".*",
                "current": {"text": ["All"], "value": ["$__all"]}}


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    variables: list[Variable]
    panels: list[Panel] = field(default_factory=list)

    def json(self) -> dict:
        panels = []
        for i, p in enumerate(self.panels):
            targets = [{"refId": chr(ord("A") + j), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend,
                        **({"instant": True, "format": "table"} if p.kind == "table" else {"range": True})}
                       for j, (expr, legend) in enumerate(p.targets)]
            panels.append({"id": i + 1, "type": p.kind, "title": p.title, "description": p.description,
                           "datasource": DATASOURCE, "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                           "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
                           "options": {"legend": {"displayMode": "list", "placement": "bottom"}}, "targets": targets})
        datasource = {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source",
                      "current": {"text": "Prometheus", "value": "prometheus"}}
        return {"uid": self.uid, "title": self.title, "description": self.description, "tags": ["loraplane"],
                "schemaVersion": 39, "version": 1, "editable": True, "timezone": "browser", "refresh": "30s",
                "time": {"from": "now-1h", "to": "now"}, "graphTooltip": 1,
                "templating": {"list": [datasource, *(v.json() for v in self.variables)]}, "panels": panels}


def engines(metric: str) -> Variable:
    return Variable("instance", f'label_values({metric}{{job="{ENGINE_JOB}"}}, instance)')


FLEET = Dashboard("loraplane-fleet", "loraplane / Fleet", "Every engine: traffic, latency, queues, KV cache",
                  [engines("loraplane_kv_blocks_total")], [
    Panel("Scrape targets up", [(f'up{{job=~"{ENGINE_JOB}|{CONTROL_JOB}|{ROUTER_JOB}"}}', "{{job}} {{instance}}")],
          description="1: Prometheus reads the process's /metrics"),
    Panel("Requests/s by engine and outcome", [(rate("loraplane_requests_total", E, "instance, outcome"),
                                                "{{instance}} {{outcome}}")], "reqps"),
    Panel("Output tokens/s by engine", [(rate("loraplane_generation_tokens_total", E, "instance"), "{{instance}}")]),
    Panel("Prompt tokens/s by engine", [(rate("loraplane_prompt_tokens_total", E, "instance"), "{{instance}}")]),
    Panel("Time to first token", quantiles("loraplane_time_to_first_token_seconds", E, "instance", "{{instance}}"),
          "s"),
    Panel("Inter-token latency", quantiles("loraplane_inter_token_latency_seconds", E, "instance", "{{instance}}"),
          "s"),
    Panel("End-to-end request latency", quantiles("loraplane_e2e_request_latency_seconds", E, "instance",
                                                  "{{instance}}"), "s"),
    Panel("Queue: running and waiting sequences", [
        (f"sum by (instance) (loraplane_running_sequences{{{E}}})", "running {{instance}}"),
        (f"sum by (instance) (loraplane_waiting_sequences{{{E}}})", "waiting {{instance}}")]),
    Panel("KV cache blocks in use", [
        (f"sum by (instance) (loraplane_kv_blocks_used{{{E}}}) / sum by (instance) (loraplane_kv_blocks_total{{{E}}})",
         "{{instance}}")], "percentunit"),
    Panel("Preemptions/s", [(rate("loraplane_num_preemptions_total", E, "instance"), "{{instance}}")],
          description="running sequences whose KV blocks were freed because the cache was full"),
    Panel("Prefix cache hit rate", [(
        f"{rate('loraplane_prefix_cache_hit_tokens_total', E, 'instance')} / "
        f"{rate('loraplane_prefix_cache_queried_tokens_total', E, 'instance')}", "{{instance}}")], "percentunit"),
    Panel("LoRA device slots in use", [
        (f"sum by (instance) (loraplane_lora_slots_used{{{E}}})", "used {{instance}}"),
        (f"sum by (instance) (loraplane_lora_slots_total{{{E}}})", "total {{instance}}")]),
])

ADAPTERS = Dashboard("loraplane-adapters", "loraplane / Adapters", "Per adapter: traffic, latency, errors, residency",
                     [engines("loraplane_requests_total"),
                      Variable("adapter", f'label_values(loraplane_requests_total{{job="{ENGINE_JOB}"}}, adapter)'),
                      Variable("topn", "10,5,20,50", custom=True)], [
    Panel("Requests/s by adapter and outcome", [(rate("loraplane_requests_total", A, "adapter, outcome"),
                                                 "{{adapter}} {{outcome}}")], "reqps"),
    Panel("Output tokens/s by adapter", [(rate("loraplane_generation_tokens_total", A, "adapter"), "{{adapter}}")]),
    Panel("Time to first token p99 by adapter", [(quantile(0.99, "loraplane_time_to_first_token_seconds", A,
                                                           "adapter"), "{{adapter}}")], "s"),
    Panel("Error ratio by adapter", [(ratio(rate("loraplane_requests_total", A + ',outcome="error"', "adapter"),
                                            rate("loraplane_requests_total", A, "adapter")), "{{adapter}}")],
          "percentunit", description="requests that ended in an engine error, of all finished"),
    Panel("Residency: engines holding the adapter in a device slot", [
        (f"sum by (adapter) (loraplane_lora_device_resident{{{A}}})", "{{adapter}}")],
          description="0: held in host memory only (its next request copies it in)"),
    Panel("Slot loads and evictions/s by adapter", [
        (rate("loraplane_lora_loads_total", A, "adapter"), "loads {{adapter}}"),
        (rate("loraplane_lora_evictions_total", A, "adapter"), "evictions {{adapter}}")]),
    Panel("Slot load time p99 by adapter", [(quantile(0.99, "loraplane_lora_load_seconds", A, "adapter"),
                                             "{{adapter}}")], "s"),
    Panel("Running and waiting sequences by adapter", [
        (f"sum by (adapter) (loraplane_lora_running_sequences{{{A}}})", "running {{adapter}}"),
        (f"sum by (adapter) (loraplane_lora_waiting_sequences{{{A}}})", "waiting {{adapter}}")]),
    Panel("Top adapters by output tokens/s", [(f"topk($topn, {rate('loraplane_generation_tokens_total', E, 'adapter')})",
                                               "{{adapter}}")], kind="table"),
    Panel("Top adapters by requests/s", [(f"topk($topn, {rate('loraplane_requests_total', E, 'adapter')})",
                                          "{{adapter}}")], kind="table"),
])

CONTROL = Dashboard("loraplane-control-plane", "loraplane / Control plane", "Admin API, pushes, reconcile rounds",
                    [Variable("instance", f'label_values(up{{job="{CONTROL_JOB}"}}, instance)')], [
    Panel("API requests/s by route and status", [(rate("loraplane_control_requests_total", C, "route, status"),
                                                  "{{route}} {{status}}")], "reqps"),
    Panel("API latency by route", quantiles("loraplane_control_request_seconds", C, "route", "{{route}}"), "s"),
    Panel("Mutations/s by action and outcome", [(rate("loraplane_control_mutations_total", C, "action, outcome"),
                                                 "{{action}} {{outcome}}")]),
    Panel("Push calls to engines/s", [(rate("loraplane_control_engine_calls_total", C + ',source="push"',
                                            "action, outcome"), "{{action}} {{outcome}}")]),
    Panel("Reconcile rounds/s by result", [(rate("loraplane_control_reconcile_rounds_total", C, "result"),
                                            "{{result}}")]),
    Panel("Reconcile calls to engines/s", [(rate("loraplane_control_engine_calls_total", C + ',source="reconcile"',
                                                 "action, outcome"), "{{action}} {{outcome}}")]),
    Panel("Reconcile drift by engine", [(f"max by (engine) (loraplane_control_reconcile_drift{{{C}}})", "{{engine}}")],
          description="placements the last round of the engine found out of step with desired; 0 when converged"),
    Panel("Artifact bytes/s streamed to engines", [(rate("loraplane_control_artifact_bytes_total", C, "instance"),
                                                    "{{instance}}")], "Bps"),
])

ROUTER = Dashboard("loraplane-router", "loraplane / Router", "Routing: affinity, retries, upstream latency",
                   [Variable("instance", f'label_values(up{{job="{ROUTER_JOB}"}}, instance)')], [
    Panel("Requests/s by model and outcome", [(rate("loraplane_router_requests_total", R, "model, outcome"),
                                               "{{model}} {{outcome}}")], "reqps"),
    Panel("Requests/s by engine", [(rate("loraplane_router_requests_total", R, "engine"), "{{engine}}")], "reqps"),
    Panel("Affinity hit rate", [
        (f"sum(rate(loraplane_router_affinity_total{{{R},result=\"hit\"}}[{RATE}])) / "
         f"sum(rate(loraplane_router_affinity_total{{{R}}}[{RATE}]))", "adapter: device-resident holder"),
        (f"sum(rate(loraplane_router_prefix_affinity_total{{{R},result=\"hit\"}}[{RATE}])) / "
         f"sum(rate(loraplane_router_prefix_affinity_total{{{R}}}[{RATE}]))", "base model: prompt-prefix engine")],
          "percentunit"),
    Panel("Retries/s by reason", [(rate("loraplane_router_retries_total", R, "reason"), "{{reason}}")]),
    Panel("Upstream time to first byte by engine", quantiles("loraplane_router_upstream_ttft_seconds", R, "engine",
                                                              "{{engine}}"), "s"),
    Panel("Outstanding requests by engine", [(f"sum by (engine) (loraplane_router_outstanding_requests{{{R}}})",
                                              "{{engine}}")]),
    Panel("Routing table age", [(f"max by (instance) (loraplane_router_routing_table_age_seconds{{{R}}})",
                                 "{{instance}}")], "s", description="-1 before the first table"),
    Panel("Table revalidations and demand reports/s", [
        (rate("loraplane_router_table_revalidations_total", R, "result"), "revalidation {{result}}"),
        (rate("loraplane_router_demand_reports_total", R, "result"), "demand report {{result}}")]),
    Panel("On-demand placements/s by outcome", [(rate("loraplane_router_placements_total", R, "outcome"),
                                                 "{{outcome}}")],
          description="requests for an adapter no engine held, placed by the control plane"),
])

DASHBOARDS = [FLEET, ADAPTERS, CONTROL, ROUTER]


def rendered() -> dict[Path, str]:
    return {OUT / f"{d.uid}.json": json.dumps(d.json(), indent=2) + "\n" for d in DASHBOARDS}


def main(argv: list[str]) -> int:
    files = rendered()
    if "--check" in argv:
        stale = [p.name for p, text in files.items() if not p.exists() or p.read_text() != text]
        extra = sorted(p.name for p in OUT.glob("*.json") if p not in files)
        for name in stale + extra:
            print(f"{name}: differs from deploy/grafana/generate.py (run it to rewrite)", file=sys.stderr)
        return 1 if stale or extra else 0
    OUT.mkdir(exist_ok=True)
    for path, text in files.items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
