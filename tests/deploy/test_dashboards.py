"""The Grafana dashboards of deploy/grafana/ against a real Prometheus (Debian's `prometheus`).

A control plane, one engine (--max-loras 1, so that rotating the three demo adapters loads and evicts) and
the router run as processes; Prometheus scrapes the three every second on loopback; traffic goes through
the router (base model, each adapter, streams, an unknown name). Then every target of every panel is
evaluated through Prometheus's HTTP API with the dashboard's variables substituted as Grafana would (each
query variable by the values its own query finds, which must be some): each parses, and each returns at
least one series with a number, except the panels listed in EVENT_ONLY, which this traffic does not cause
and which must parse. Fast checks beside it: the JSON files are what deploy/grafana/generate.py writes,
every variable an expression uses is defined, and the scrape jobs are those of deploy/prometheus/scrape.yaml.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest
import yaml

from tests.data_plane.api.conftest import SHARED_FLAGS, run_engine, scrape_metric
from tests.e2e.test_control_plane_engines import (
    ADMIN,
    CP_TOKENS,
    _free_port,
    control_plane,
    engine_token,
    started,
)
from tests.tools import require_tool

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "deploy" / "grafana"
ROUTER_TOKEN, ENGINE_KEY, CLIENT_KEY = "dash-router-token", "dash-engine-api-key", "dash-client-key"
ADAPTERS = ("demo-pirate", "demo-poet", "demo-short")
# (dashboard uid, panel title): panels of events this traffic does not cause; their queries must parse
EVENT_ONLY = {("loraplane-router", "On-demand placements/s by outcome")}
RATE_WINDOW = "2m"  # $__rate_interval: longer than the whole run, so every rate sees all of its traffic


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grafana_generate", GRAFANA / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def dashboards() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((GRAFANA / "dashboards").glob("*.json"))]


def targets(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(panel title, expression) of every target of every panel."""
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            yield panel["title"], target["expr"]


def test_the_json_files_are_what_the_generator_writes() -> None:
    result = subprocess.run([sys.executable, str(GRAFANA / "generate.py"), "--check"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_dashboards_are_well_formed() -> None:
    boards = dashboards()
    assert {d["uid"] for d in boards} == {"loraplane-fleet", "loraplane-adapters", "loraplane-control-plane",
                                          "loraplane-router"}
    for d in boards:
        defined = {v["name"] for v in d["templating"]["list"]} | {"__rate_interval"}
        assert len({p["id"] for p in d["panels"]}) == len(d["panels"]), d["uid"]
        assert len({p["title"] for p in d["panels"]}) == len(d["panels"]), d["uid"]  # EVENT_ONLY names them
        for title, expr in targets(d):
            used = set(re.findall(r"\$(\w+)", expr))
            assert used <= defined, (d["uid"], title, used - defined)
    named = {(d["uid"], p["title"]) for d in boards for p in d["panels"]}
    assert named >= EVENT_ONLY


def test_the_scrape_jobs_are_the_dashboards_jobs() -> None:
    g = generator()
    jobs = {c["job_name"] for c in yaml.safe_load((REPO / "deploy/prometheus/scrape.yaml").read_text())["scrape_configs"]}
    assert jobs == {g.ENGINE_JOB, g.CONTROL_JOB, g.ROUTER_JOB}


class Prometheus:
    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=30)

    def query(self, expr: str) -> tuple[str | None, list[dict]]:
        """(error or None, the result vector)."""
        body = self.http.get("/api/v1/query", params={"query": expr}).json()
        if body["status"] != "success":
            return f"{body.get('errorType')}: {body.get('error')}", []
        assert body["data"]["resultType"] == "vector", (expr, body["data"]["resultType"])
        return None, body["data"]["result"]

    def label_values(self, selector: str, label: str) -> list[str]:
        body = self.http.get(f"/api/v1/label/{label}/values", params={"match[]": selector}).json()
        assert body["status"] == "success", body
        return body["data"]

    def scalar(self, expr: str) -> float | None:
        error, result = self.query(expr)
        assert error is None, error
        return float(result[0]["value"][1]) if result else None


@contextlib.contextmanager
def prometheus(binary: str, tmp: Path, jobs: dict[str, str]) -> Iterator[Prometheus]:
    """Prometheus on loopback scraping each job's one target every second; stopped when the block ends."""
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": job, "scrape_interval": "1s", "scrape_timeout": "1s",
                                  "static_configs": [{"targets": [target]}]} for job, target in jobs.items()]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
           f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    with started(cmd, tmp / "prometheus.log", dict(os.environ),
                 lambda: httpx.get(url + "/-/ready", timeout=2).status_code == 200, "prometheus"):
        yield Prometheus(url)


def host_port(url: str) -> str:
    return url.removeprefix("http://")


def wait_for(predicate, what: str, timeout_s: float = 30) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def send_traffic(router: str) -> None:
    key = {"Authorization": f"Bearer {CLIENT_KEY}"}
    with httpx.Client(base_url=router, headers=key, timeout=60) as client:
        def complete(model: str, prompt: str = "The quick brown fox", **extra: object) -> httpx.Response:
            return client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 6,
                                                        "temperature": 0, **extra})

        for i in range(3):  # base model: the same prefix twice makes a prefix-affinity hit
            assert complete("demo", "Once upon a time").status_code == 200
            for name in ADAPTERS:  # one slot: every switch evicts the last adapter and loads the next
                r = complete(name, stream=i == 1)
                assert r.status_code == 200, r.text
        assert complete("no-such-adapter").status_code == 404


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    from data_plane.demo.adapters import write_demo_adapters
    from data_plane.demo.model_builder import write_demo_model

    binary = require_tool("prometheus")  # before anything starts: a skip starts nothing
    tmp = tmp_path_factory.mktemp("dashboards")
    base = tmp / "models" / "demo"
    write_demo_model(base, seed=0)
    root = tmp / "adapters"
    paths = write_demo_adapters(base, root)
    with contextlib.ExitStack() as stack:
        cp = stack.enter_context(control_plane(
            tmp, root, LORAPLANE_ROUTER_TOKENS=ROUTER_TOKEN, LORAPLANE_RECONCILE_INTERVAL_S="1"))
        engine = stack.enter_context(run_engine(
            base, tmp / "engine.log", "--enable-lora", "--max-loras", "1", "--lora-roots", str(root),
            "--admin-token", engine_token("e1"), "--control-plane", cp, "--engine-name", "e1", *SHARED_FLAGS,
            "--heartbeat-interval-s", "0.5",
            env={"LORAPLANE_CONTROL_PLANE_TOKEN": CP_TOKENS["e1"], "LORAPLANE_API_KEY": ENGINE_KEY}))
        router_port = _free_port()
        router = f"http://127.0.0.1:{router_port}"
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")}, "PYTHONUNBUFFERED": "1",
               "LORAPLANE_ROUTER_TOKEN": ROUTER_TOKEN, "LORAPLANE_ENGINE_API_KEY": ENGINE_KEY,
               "LORAPLANE_API_KEYS": CLIENT_KEY}
        stack.enter_context(started(
            [sys.executable, "-m", "shared.cli", "router", "--control-plane", cp, "--port", str(router_port)],
            tmp / "router.log", env,
            lambda: httpx.get(router + "/health", timeout=2).json()["routing_table"]["engines"] == 1, "router"))
        g = generator()
        prom = stack.enter_context(prometheus(binary, tmp, {g.ENGINE_JOB: host_port(engine.url),
                                                    g.CONTROL_JOB: host_port(cp), g.ROUTER_JOB: host_port(router)}))
        admin = {"Authorization": f"Bearer {ADMIN}"}
        for name in ADAPTERS:
            r = httpx.post(cp + "/v1/load_lora_adapter", headers=admin, timeout=120, json={
                "lora_name": name, "lora_path": str(paths[name]), "base_model": "demo"})
            assert r.status_code == 200, r.text
        models = lambda: {m["id"] for m in httpx.get(router + "/v1/models", timeout=5, headers={  # noqa: E731
            "Authorization": f"Bearer {CLIENT_KEY}"}).json()["data"]}
        wait_for(lambda: models() >= {"demo", *ADAPTERS}, "the router's table to list the adapters")
        wait_for(lambda: prom.scalar("count(up == 1)") == 3, "every target up")

        def scrapes() -> float:  # when every target was last scraped
            return prom.scalar("min(timestamp(up))") or 0

        def caught_up(metric: str, job: str, url: str) -> bool:
            return prom.scalar(f'sum({metric}{{job="{job}"}})') == scrape_metric(url, metric)

        # Twice: the traffic, then the scrapes that saw it (its sums in Prometheus equal the processes' own) and
        # one more. A series the first round makes is then scraped before the second adds to it, so that every
        # rate of the traffic has two samples in its window and a rise between them.
        for _ in range(2):
            send_traffic(router)
            wait_for(lambda: caught_up("loraplane_requests_total", g.ENGINE_JOB, engine.url)
                     and caught_up("loraplane_lora_evictions_total", g.ENGINE_JOB, engine.url)
                     and caught_up("loraplane_router_requests_total", g.ROUTER_JOB, router), "the traffic's scrapes")
            seen = scrapes()
            wait_for(lambda: scrapes() > seen, "one more scrape of every target")  # noqa: B023
        yield prom


def substitutions(prom: Prometheus, dashboard: dict) -> dict[str, str]:
    """Each variable's value as Grafana would put it into an expression: a query variable's values found by
    its own query, as a regex alternation (escaped, inside a PromQL string); a custom one's first option."""
    values = {"__rate_interval": RATE_WINDOW}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "custom":
            values[variable["name"]] = variable["current"]["value"]
        elif variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]["query"])
            assert match, variable
            found = prom.label_values(match[1], match[2])
            assert found, f"{dashboard['uid']}: variable {variable['name']} finds no values"
            values[variable["name"]] = "(" + "|".join(re.escape(v).replace("\\", "\\\\") for v in found) + ")"
    return values


def substituted(expr: str, values: dict[str, str]) -> str:
    return re.sub(r"\$(\w+)", lambda m: values[m[1]], expr)


def test_every_panel_query_parses_and_returns_series(scraped: Prometheus) -> None:
    problems, evaluated = [], 0
    for dashboard in dashboards():
        values = substitutions(scraped, dashboard)
        for title, expr in targets(dashboard):
            error, result = scraped.query(substituted(expr, values))
            evaluated += 1
            if error is not None:
                problems.append(f"{dashboard['uid']} / {title}: {error}\n    {expr}")
            elif (dashboard["uid"], title) not in EVENT_ONLY and not any(
                    math.isfinite(float(s["value"][1])) for s in result):
                problems.append(f"{dashboard['uid']} / {title}: {len(result)} series, none with a number\n    {expr}")
    assert evaluated >= 40
    assert not problems, "\n".join(problems)
