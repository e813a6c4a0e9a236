"""The fewest device-slot loads bench/fleet.py's request lists allow: an offline bound, not a measurement.

    .venv/bin/python bench/fleet_floor.py [--requests 240] [--seeds 3] [--slots 4] [--window 16]

For each engine's share of a request list, loads are counted under Belady's rule (on a miss, evict the
resident adapter whose next request is furthest away: the optimum for a known sequence, which no online
eviction beats), and a request whose adapter was requested within the last `window` requests of the same
engine rides that earlier load (the two would be waiting together: the engine's scheduler loads an
adapter once for all its waiting requests). Two ways of splitting the list over the engines, and a bound
for every way:

- round_robin: request i to engine i mod E (bench/fleet.py's mode b);
- demand_placed: each adapter held by one engine, the hottest first onto the engine with the least demand
  so far (the best a placement by demand weight can do for slot loads: no adapter on two engines), and
  every request to its adapter's engine;
- any_routing: the whole fleet as one engine of E x slots slots whose requests all wait together within
  E x window (the client's whole concurrency). Splitting the slots over engines only adds constraints, so
  no routing, placement or eviction, online or not, makes fewer loads than this under the window's
  model.

`demand_placed / round_robin` is then about what routing can reach at best against round-robin, and
`any_routing` what no routing beats: the figures at bench/fleet.py's setting (48 adapters, Zipf(1.0), 3
engines of 4 slots, a window of 16) are in docs/performance.md#router-and-fleet. Replicas cost loads:
each replica takes a slot on every engine holding it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Sequence

ADAPTERS, ENGINES = 48, 3


def zipf_adapters(n: int, seed: int, adapters: int = ADAPTERS) -> list[int]:
    """The adapter index of each request, as bench/fleet.py's request_list draws them (same seed, same list)."""
    rng = random.Random(seed)
    return rng.choices(list(range(adapters)), weights=[1 / (k + 1) for k in range(adapters)], k=n)


def belady_loads(seq: Sequence[int], slots: int, window: int) -> int:
    """Loads of `seq` on one engine with `slots` device slots (see the module doc)."""
    last: dict[int, int] = {}
    misses = []  # the requests that may need a load: the others ride one within the window
    for i, adapter in enumerate(seq):
        if adapter not in last or i - last[adapter] > window:
            misses.append(adapter)
        last[adapter] = i
    far = len(misses)
    next_use, seen = [far] * far, {}
    for i in range(far - 1, -1, -1):
        next_use[i] = seen.get(misses[i], far)
        seen[misses[i]] = i
    upcoming: dict[int, int] = {}  # resident adapter -> index of its next miss
    loads = 0
    for i, adapter in enumerate(misses):
        if adapter not in upcoming:
            loads += 1
            if len(upcoming) >= slots:
                del upcoming[max(upcoming, key=upcoming.__getitem__)]
        upcoming[adapter] = next_use[i]
    return loads


def demand_placement(adapters: int = ADAPTERS, engines: int = ENGINES) -> dict[int, int]:
    """Adapter -> engine: hottest first onto the engine with the least Zipf(1.0) demand so far."""
    demand, where = [0.0] * engines, {}
    for k in range(adapters):
        where[k] = min(range(engines), key=demand.__getitem__)
        demand[where[k]] += 1 / (k + 1)
    return where


def floors(seq: Sequence[int], slots: int = 4, window: int = 16, engines: int = ENGINES) -> dict[str, int]:
    where = demand_placement(max(seq) + 1 if seq else 0, engines)
    return {"round_robin": sum(belady_loads(seq[e::engines], slots, window) for e in range(engines)),
            "demand_placed": sum(belady_loads([a for a in seq if where[a] == e], slots, window)
                                 for e in range(engines)),
            "any_routing": belady_loads(seq, slots * engines, window * engines)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--window", type=int, default=16, help="requests of one engine that wait together")
    args = parser.parse_args()
    rows = [floors(zipf_adapters(args.requests, seed), args.slots, args.window) for seed in range(args.seeds)]
    ratios = [r["demand_placed"] / r["round_robin"] for r in rows]
    bound = [r["any_routing"] / r["round_robin"] for r in rows]
    print(json.dumps({"benchmark": "fleet_floor", "requests": args.requests, "slots": args.slots,
                      "window": args.window, "per_seed": rows,
                      "demand_placed_over_round_robin": {"median": round(statistics.median(ratios), 3),
                                                         "range": [round(min(ratios), 3), round(max(ratios), 3)]},
                      "any_routing_over_round_robin": {"median": round(statistics.median(bound), 3),
                                                       "range": [round(min(bound), 3), round(max(bound), 3)]}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
