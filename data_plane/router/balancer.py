"""Which engine takes a request: residency first, then the fewest outstanding requests.

For a model's holders (`ModelRoute.holders`), the order is:

    key(holder)  = (engine refused a connection in the last engine_down_s, RESIDENCY_RANK[residency])
    best         = the holders with the smallest key          # device < host < loading
    first        = power of two choices among `best`: two at random, the one with fewer outstanding
    rest         = the other holders by (key, outstanding)    # what a retry tries next

Requests carry an affinity key: a base-model request its prompt prefix's, an adapter request the adapter's.
The engine that last served that key goes first when it is among `best` and has at most `affinity_slack`
more outstanding requests than the least busy of them: a prompt prefix's KV is still in its prefix cache,
and an adapter is still in one of its few device slots (the table's residency is seconds old, slots change
every step), where the new request joins the running ones without a load; spreading an adapter over its
replicas instead would take a slot on each. The slack keeps one engine from taking every such request.

Outstanding counts are the router's own (requests sent and not finished), per engine and per model; the
per-model ones are what the router reports as `running` demand.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from dataclasses import dataclass

from data_plane.router.table import RoutingTable
from shared.routes import RESIDENCY_RANK, ModelRoute, RouteEngine


@dataclass(frozen=True, slots=True)
class Candidate:
    engine: RouteEngine
    residency: str
    preferred: bool = False  # the engine that last served this prompt prefix or adapter


class Balancer:
    def __init__(self, *, prefix_cache_size: int = 16384, affinity_slack: int = 8, engine_down_s: float = 2.0,
                 rng: random.Random | None = None) -> None:
        self.outstanding: dict[str, int] = {}  # engine name -> requests in flight there
        self.running: dict[str, int] = {}  # model -> requests in flight for it
        self.affinity_slack = affinity_slack
        self.engine_down_s = engine_down_s
        self._last_served: OrderedDict[int, str] = OrderedDict()  # affinity key -> engine that last served it
        self._prefix_cache_size = prefix_cache_size
        self._down_until: dict[str, float] = {}
        self._rng = rng or random.Random()

    def order(self, route: ModelRoute, table: RoutingTable, affinity: int | None = None) -> list[Candidate]:
        """The holders of `route` that the table knows, best first (see the module docstring)."""
        now = time.monotonic()
        keyed: list[tuple[tuple[bool, int], Candidate]] = []
        for holder in route.holders:
            engine = table.engine(holder.engine)
            if engine is not None:
                down = self._down_until.get(engine.name, 0.0) > now
                keyed.append(((down, RESIDENCY_RANK[holder.residency]), Candidate(engine, holder.residency)))
        if not keyed:
            return []
        best_key = min(key for key, _ in keyed)
        best = [c for key, c in keyed if key == best_key]
        first = self._preferred(best, affinity) or self._two_choices(best)
        rest = sorted((kc for kc in keyed if kc[1].engine.name != first.engine.name),
                      key=lambda kc: (kc[0], self.outstanding.get(kc[1].engine.name, 0)))
        return [first, *(c for _, c in rest)]

    def _two_choices(self, best: list[Candidate]) -> Candidate:
        if len(best) == 1:
            return best[0]
        a, b = self._rng.sample(best, 2)
        load_a, load_b = self.outstanding.get(a.engine.name, 0), self.outstanding.get(b.engine.name, 0)
        return a if load_a <= load_b else b

    def _preferred(self, best: list[Candidate], affinity: int | None) -> Candidate | None:
        if affinity is None or (name := self._last_served.get(affinity)) is None:
            return None
        least = min(self.outstanding.get(c.engine.name, 0) for c in best)
        for c in best:
            if c.engine.name == name and self.outstanding.get(name, 0) <= least + self.affinity_slack:
                return Candidate(c.engine, c.residency, preferred=True)
        return None

    def served(self, affinity: int | None, engine: str) -> None:
        """`engine` answered a request with this affinity key: the next one like it goes there too."""
        if affinity is None:
            return
        self._last_served[affinity] = engine
        self._last_served.move_to_end(affinity)
        if len(self._last_served) > self._prefix_cache_size:
            self._last_served.popitem(last=False)

    def mark_down(self, engine: str) -> None:
        """`engine` refused a connection: try it last for a while (the control plane will drop it soon)."""
        self._down_until[engine] = time.monotonic() + self.engine_down_s

    def begin(self, engine: str, model: str) -> None:
        self.outstanding[engine] = self.outstanding.get(engine, 0) + 1
        self.running[model] = self.running.get(model, 0) + 1

    def end(self, engine: str, model: str) -> None:
        self.outstanding[engine] -= 1
        self.running[model] -= 1
        if not self.running[model]:
            del self.running[model]  # bounded by what is in flight, however many names clients send
