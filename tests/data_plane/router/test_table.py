"""The routing table from a real HTTP server: revalidated with If-None-Match (304s counted), replaced when
it changes, kept while the control plane is down (/health degraded), and the router token sent; the
context length of each model read off it."""

from __future__ import annotations

import contextlib

import httpx

from shared.routes import ModelRoute, RouteEngine
from tests.data_plane.api.conftest import scrape_metric
from tests.data_plane.router.support import (
    RoutesServer,
    adapter_route,
    base_route,
    serve_router,
    serve_routes,
    wait_until,
)

E1 = RouteEngine(name="e1", url="http://127.0.0.1:9", base_model="demo")
E2 = RouteEngine(name="e2", url="http://127.0.0.1:10", base_model="demo")


def test_revalidation_304s_changes_and_outage() -> None:
    routes = RoutesServer(engines=[E1], models=[base_route("demo", "e1")])
    with contextlib.ExitStack() as control_plane:
        control_plane.enter_context(serve_routes(routes))
        with serve_router(routes.url, refresh_interval_s=0.1, stale_after_s=0.5) as router:
            service = router.service
            wait_until(lambda: service.refresher.results["not_modified"] >= 3, "three 304s")
            assert routes.counts["200"] == 1 and routes.counts["401"] == 0  # the router token was sent
            health = httpx.get(router.url + "/health").json()
            assert health["status"] == "ok" and health["routing_table"]["engines"] == 1
            models = httpx.get(router.api + "/models").json()["data"]
            assert [(m["id"], m["parent"]) for m in models] == [("demo", None)]

            routes.set([E1, E2], [base_route("demo", "e1", "e2")])  # a new table: one 200, then 304s again
            wait_until(lambda: set(service.table.engines) == {"e1", "e2"}, "the new table")
            assert routes.counts["200"] == 2
            assert scrape_metric(router.url, "loraplane_router_table_revalidations_total", 'result="changed"') == 2

            control_plane.close()  # the control plane goes away: the last table is kept, /health degraded
            wait_until(lambda: httpx.get(router.url + "/health").json()["status"] == "degraded", "degraded")
            body = httpx.get(router.url + "/health").json()
            assert body["routing_table"]["engines"] == 2 and "last one" in body["reason"]
            assert [m["id"] for m in httpx.get(router.api + "/models").json()["data"]] == ["demo"]
            assert scrape_metric(router.url, "loraplane_router_table_revalidations_total", 'result="failed"') >= 1
            assert scrape_metric(router.url, "loraplane_router_routing_table_age_seconds") > 0.5


def test_no_table_yet_is_503_on_health() -> None:
    with serve_router("http://127.0.0.1:9", refresh_interval_s=0.1) as router:
        r = httpx.get(router.url + "/health")
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert scrape_metric(router.url, "loraplane_router_routing_table_age_seconds") == -1


def test_each_model_runs_in_its_base_models_context_length() -> None:
    demo = ModelRoute(model="demo", kind="base", base_model="demo", holders=[], max_model_len=512)
    long = ModelRoute(model="long", kind="base", base_model="long", holders=[], max_model_len=4096)
    routes = RoutesServer(engines=[E1], models=[demo, long, adapter_route("a", "demo", e1="device"),
                                                 base_route("silent", "e1")])
    with serve_routes(routes), serve_router(routes.url) as router:
        table = router.service.table
        assert table.context_length("demo") == 512
        assert table.context_length("a") == 512  # an adapter route without one: its base model's
        # a model the table does not know, or whose engines did not say: the largest the table knows
        assert table.context_length("silent") == table.context_length("unknown") == 4096
        routes.set([E1], [base_route("silent", "e1")])
        wait_until(lambda: "demo" not in table.models, "the new table")
        assert table.context_length("silent") is None  # no engine said
