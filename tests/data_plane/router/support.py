"""What the router tests run against: a routes server on loopback, and the router itself served over HTTP.

`RoutesServer` answers the router's two control-plane calls by the contract of shared/routes.py (GET
/v1/routes with an ETag and 304s, POST /v1/routes/demand), from a table the test sets, and records what it
was asked. It is the control plane's wire contract and nothing more, so that the router's own rules
(revalidation, coalescing, ranking) can be driven exactly; tests/e2e/test_router.py runs the router
against the real control plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import msgspec
from litestar import Litestar, Request, Response, get, post

from data_plane.router.app import create_app
from data_plane.router.config import RouterConfig
from data_plane.router.service import RouterService
from shared.routes import DemandAnswer, DemandReport, Holder, ModelRoute, RouteEngine, RoutesTable
from tests.control_plane.engines import serve_app
from tests.e2e.test_control_plane_engines import KEY_PEPPER, _free_port

ROUTER_TOKEN = "router-token-for-tests"


@dataclass
class RoutesServer:
    """The routes and demand endpoints; `placements`: adapter -> the route a placement request returns."""

    engines: list[RouteEngine] = field(default_factory=list)
    models: list[ModelRoute] = field(default_factory=list)
    placements: dict[str, ModelRoute] = field(default_factory=dict)
    place_delay_s: float = 0.0  # how long a placement takes (so that requests pile up on it)
    counts: dict[str, int] = field(default_factory=lambda: {"200": 0, "304": 0, "401": 0})
    place_calls: list[list[str]] = field(default_factory=list)
    demand: list[DemandReport] = field(default_factory=list)  # reports with figures
    url: str = ""

    def set(self, engines: list[RouteEngine], models: list[ModelRoute]) -> None:
        self.engines, self.models = engines, models

    def table(self) -> RoutesTable:
        body = msgspec.json.encode([self.engines, self.models])
        return RoutesTable(etag=f'"{hash(body) & 0xFFFFFFFF:08x}"', engines=self.engines, models=self.models)

    def app(self) -> Litestar:
        @get("/v1/routes", sync_to_thread=False)
        def routes(request: Request) -> Response:
            if request.headers.get("authorization") != f"Bearer {ROUTER_TOKEN}":
                self.counts["401"] += 1
                return Response({"error": {"message": "no"}}, status_code=401)
            table = self.table()
            if request.headers.get("if-none-match") == table.etag:
                self.counts["304"] += 1
                return Response(b"", status_code=304, headers={"ETag": table.etag})
            self.counts["200"] += 1
            return Response(msgspec.json.encode(table), media_type="application/json", headers={"ETag": table.etag})

        @post("/v1/routes/demand", status_code=200)
        async def demand(request: Request) -> Response:
            report = msgspec.json.decode(await request.body(), type=DemandReport)
            if report.demand:
                self.demand.append(report)
            if report.place:
                self.place_calls.append(list(report.place))
                await asyncio.sleep(self.place_delay_s)
            placed = [self.placements[n] for n in report.place if n in self.placements]
            for route in placed:  # placed: the table lists it from now on
                self.models = [*(m for m in self.models if m.model != route.model), route]
            answer = DemandAnswer(placed=placed, unknown=[n for n in report.place if n not in self.placements])
            return Response(msgspec.json.encode(answer), media_type="application/json")

        return Litestar([routes, demand], logging_config=None)


@contextlib.contextmanager
def serve_routes(server: RoutesServer) -> Iterator[RoutesServer]:
    with serve_app(server.app(), _free_port()) as url:
        server.url = url
        yield server


@dataclass
class RouterUnderTest:
    url: str
    service: RouterService

    @property
    def api(self) -> str:
        return self.url + "/v1"


@contextlib.contextmanager
def serve_router(control_plane: str, **config: object) -> Iterator[RouterUnderTest]:
    """The router app on a free loopback port, in a thread of its own, until the block ends."""
    settings: dict[str, object] = {"router_token": ROUTER_TOKEN, "key_pepper": KEY_PEPPER, **config}
    app = create_app(RouterConfig(control_plane_url=control_plane, **settings))  # type: ignore[arg-type]
    with serve_app(app, _free_port()) as url:
        yield RouterUnderTest(url, app.state.router)


def wait_until(condition: Callable[[], object], what: str | Callable[[], str], timeout_s: float = 20.0) -> None:
    """Polls `condition`; `what` may be a callable, to name what was seen when the wait timed out."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(0.05)


def base_route(model: str, *engines: str) -> ModelRoute:
    return ModelRoute(model=model, kind="base", base_model=model,
                      holders=[Holder(engine=e, residency="device") for e in engines])


def adapter_route(model: str, base: str, **holders: str) -> ModelRoute:
    """holders: engine name -> residency."""
    return ModelRoute(model=model, kind="adapter", base_model=base,
                      holders=[Holder(engine=e, residency=r) for e, r in holders.items()])  # type: ignore[arg-type]

