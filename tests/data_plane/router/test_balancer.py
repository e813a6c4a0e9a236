"""Balancer: residency ranks first, then the fewest outstanding (two random choices), prefix affinity with
slack, engines that refused a connection last, holders the table does not know skipped."""

from __future__ import annotations

import random
from collections import Counter

from data_plane.router.balancer import Balancer
from data_plane.router.table import RoutingTable
from shared.routes import RouteEngine, RoutesTable
from tests.data_plane.router.support import adapter_route, base_route


def table(*names: str) -> RoutingTable:
    t = RoutingTable()
    engines = [RouteEngine(name=n, url=f"http://{n}", base_model="demo") for n in names]
    t.replace(RoutesTable(etag='"1"', engines=engines, models=[]), '"1"')
    return t


def names(candidates) -> list[str]:  # noqa: ANN001
    return [c.engine.name for c in candidates]


def test_device_before_host_before_loading_and_unknown_engines_left_out() -> None:
    b = Balancer(rng=random.Random(0))
    route = adapter_route("a", "demo", e1="loading", e2="host", e3="device", ghost="device")
    assert names(b.order(route, table("e1", "e2", "e3"))) == ["e3", "e2", "e1"]
    b.begin("e3", "a")
    b.begin("e3", "a")  # busy, but residency still decides
    assert names(b.order(route, table("e1", "e2", "e3")))[0] == "e3"


def test_two_choices_prefer_the_less_busy_and_spread_equals() -> None:
    b = Balancer(rng=random.Random(1))
    t = table("e1", "e2")
    route = base_route("demo", "e1", "e2")
    for _ in range(3):
        b.begin("e1", "demo")
    assert all(names(b.order(route, t)) == ["e2", "e1"] for _ in range(20))
    b2 = Balancer(rng=random.Random(2))
    firsts = Counter(names(b2.order(route, t))[0] for _ in range(200))  # equal loads: both get picked
    assert set(firsts) == {"e1", "e2"} and min(firsts.values()) > 50


def test_among_many_the_busiest_is_never_first() -> None:
    b = Balancer(rng=random.Random(3))
    t = table("e1", "e2", "e3")
    for _ in range(5):
        b.begin("e3", "demo")
    route = base_route("demo", "e1", "e2", "e3")
    orders = [names(b.order(route, t)) for _ in range(100)]
    assert all(o[0] != "e3" and o[-1] == "e3" and sorted(o) == ["e1", "e2", "e3"] for o in orders)


def test_an_engine_that_refused_goes_last_for_a_while() -> None:
    b = Balancer(rng=random.Random(0), engine_down_s=60)
    route = adapter_route("a", "demo", e1="device", e2="host")
    t = table("e1", "e2")
    b.mark_down("e1")
    assert names(b.order(route, t)) == ["e2", "e1"]
    b2 = Balancer(rng=random.Random(0), engine_down_s=0.001)
    b2.mark_down("e1")
    import time
    time.sleep(0.01)
    assert names(b2.order(route, t)) == ["e1", "e2"]


def test_prefix_affinity_with_slack() -> None:
    b = Balancer(rng=random.Random(0), affinity_slack=2)
    t = table("e1", "e2")
    route = base_route("demo", "e1", "e2")
    b.served(42, "e2")
    for _ in range(2):
        b.begin("e2", "demo")
    first = b.order(route, t, affinity=42)[0]
    assert (first.engine.name, first.preferred) == ("e2", True)  # 2 more than e1: within the slack
    assert len(b.order(route, t, affinity=42)) == 2  # no engine twice
    b.begin("e2", "demo")  # 3 more: the least busy wins
    assert names(b.order(route, t, affinity=42))[0] == "e1"
    assert not b.order(route, t, affinity=7)[0].preferred  # an unseen prefix


def test_prefix_memory_is_bounded_and_counts_return_to_zero() -> None:
    b = Balancer(prefix_cache_size=2)
    for key in (1, 2, 3):
        b.served(key, "e1")
    assert b._last_served.keys() == {2, 3}
    b.begin("e1", "a")
    b.end("e1", "a")
    assert b.outstanding == {"e1": 0} and b.running == {}
