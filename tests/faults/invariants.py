"""The invariants every fault test checks afterwards (`checkpoint`), and small helpers of the tests."""

from __future__ import annotations

import threading
import time

import httpx

from tests.faults.conftest import CONVERGE_WITHIN_S, Scenario


def acknowledged(s: Scenario, name: str, r: httpx.Response, version: int | None) -> None:
    assert r.status_code in (200, 207), r.text
    s.acknowledged[name] = version


def checkpoint(s: Scenario, what: str, fault_ended: float) -> None:
    budget = CONVERGE_WITHIN_S - (time.monotonic() - fault_ended)
    s.fleet.wait_converged(budget, what)
    s.timeline.converged()
    s.faults.close_all()
    assert s.driver is not None
    s.driver.stop()  # idle from here on: in-flight answers are in
    try:
        for engine in s.fleet.live_engines():
            for metric in ("loraplane_running_sequences", "loraplane_waiting_sequences", "loraplane_kv_blocks_used"):
                assert s.fleet.engine_metric(engine, metric) == 0, f"{engine} {metric} after {what}"
            listing = s.fleet.listing(engine)
            busy = {a["name"]: a["in_flight"] for a in listing["adapters"] if a["in_flight"]}
            assert not busy, f"{engine} adapters still in flight after {what}: {busy}"
            resident = sum(a["residency"] == "device" for a in listing["adapters"])
            assert listing["slots"]["used"] == resident, f"{engine} slots leaked after {what}: {listing}"
        for cp in (i for i, p in enumerate(s.fleet.cps) if p.alive):
            active = {n: d["active_version"] if any(p["desired"] != "absent" for p in d["placements"]) else None
                      for n, d in s.fleet.registry(cp).items()}
            lost = {n: (v, active.get(n)) for n, v in s.acknowledged.items() if active.get(n) != v}
            assert not lost, f"acknowledged changes lost at replica {cp} after {what}: {lost}"
        assert s.violations() == [], f"wrong answers by {what}; statuses {s.status_counts()}"
    finally:
        s.driver.start()


def background(fn) -> tuple[threading.Thread, list]:  # noqa: ANN001
    """Run fn() on a thread; the list gets its result or the exception it raised."""
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out
