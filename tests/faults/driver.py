"""Traffic whose right answer is known, and the check that every answer was right.

Each adapter folder's greedy completion of PROMPT is recorded once, on a quiet engine (`expected`).
The `Timeline` records, per adapter name, which folder it served when: a change (load, activation,
unload) opens the new state's window when it is sent; the state it replaces stays allowed until the
fleet was seen converged after the change (an engine that was down or stopped serves the old version
until the reconciler reaches it — that is the eventual consistency the design promises, bounded by
the convergence check). A request [t0, t1] for adapter A may then answer with the text of any folder
whose window overlaps it, or 404 where an "absent" window does; never another adapter's text or the
base model's. Engines' fault windows (killed, stopped, terminating) additionally allow connection
errors; 503 is a documented answer (overloaded, shutting down) and is counted; any other status fails.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

PROMPT = "The quick brown fox"
MAX_TOKENS = 6
ABSENT = None  # a Timeline state: the adapter is not served (404)


def complete(client: httpx.Client, engine_url: str, model: str, max_tokens: int = MAX_TOKENS,
             timeout_s: float = 30) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    return client.post(engine_url + "/v1/completions", json=body, timeout=timeout_s)


@dataclass
class Window:
    state: str | None  # folder key, or ABSENT
    start: float
    end: float = math.inf


@dataclass
class Timeline:
    windows: dict[str, list[Window]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def change(self, adapter: str, state: str | None) -> None:
        """Call right before sending the change that makes `adapter` serve `state`."""
        with self.lock:
            self.windows.setdefault(adapter, [Window(ABSENT, -math.inf)]).append(Window(state, time.monotonic()))

    def undo(self, adapter: str) -> None:
        """The last change was refused (4xx): it never took effect."""
        with self.lock:
            self.windows[adapter].pop()

    def converged(self) -> None:
        """The fleet was seen converged now: every state replaced before now stops being allowed."""
        now = time.monotonic()
        with self.lock:
            for windows in self.windows.values():
                for w in windows[:-1]:
                    w.end = min(w.end, now)

    def allowed(self, adapter: str, t0: float, t1: float) -> set[str | None]:
        with self.lock:
            windows = self.windows.get(adapter, [Window(ABSENT, -math.inf)])
            return {w.state for w in windows if w.start <= t1 and w.end >= t0}


@dataclass
class Outcome:
    engine: str
    adapter: str
    t0: float
    t1: float
    status: int | None  # None: no HTTP answer (connection refused, reset, timeout)
    text: str | None = None
    error: str | None = None


class Driver:
    """One thread per engine, each sending completions for the adapters in turn, back to back, to the
    engine's current url (a restarted engine has a new port); `stop()` waits for the answers in flight."""

    def __init__(self, engines: Callable[[], dict[str, str]], adapters: list[str]) -> None:
        self.engines = engines  # name -> current url of every engine to send to
        self.adapters = adapters
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        self._stop.clear()
        self._threads = [threading.Thread(target=self._run, args=(name,), daemon=True) for name in self.engines()]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def _run(self, engine: str) -> None:
        adapters = itertools.cycle(self.adapters)
        with httpx.Client() as client:
            while not self._stop.is_set():
                url = self.engines().get(engine)
                adapter = next(adapters)
                t0 = time.monotonic()
                try:
                    if url is None:
                        raise httpx.ConnectError("the engine is not running")
                    r = complete(client, url, adapter)
                except httpx.HTTPError as exc:
                    self.outcomes.append(Outcome(engine, adapter, t0, time.monotonic(), None,
                                                 error=type(exc).__name__))
                    time.sleep(0.05)  # do not spin on a dead engine
                    continue
                text = r.json()["choices"][0]["text"] if r.status_code == 200 else None
                error = None if r.status_code == 200 else r.text[:300]
                self.outcomes.append(Outcome(engine, adapter, t0, time.monotonic(), r.status_code, text, error))


@dataclass
class FaultLog:
    """When each engine was faulted: windows in which it may fail to answer at all, or answer 404 while
    it has yet to get its adapters back. A window opens with the fault and closes once the fleet was
    seen converged after it (`close_all`)."""

    windows: dict[str, list[list[float]]] = field(default_factory=dict)

    def open(self, engine: str) -> None:
        self.windows.setdefault(engine, []).append([time.monotonic(), math.inf])

    def close_all(self) -> None:
        now = time.monotonic()
        for windows in self.windows.values():
            for w in windows:
                w[1] = min(w[1], now)

    def during(self, engine: str, t0: float, t1: float) -> bool:
        return any(s <= t1 and e >= t0 for s, e in self.windows.get(engine, []))


def check(outcomes: list[Outcome], timeline: Timeline, expected: dict[str, str], faults: FaultLog) -> list[str]:
    """Every violation among `outcomes`, as readable lines ([] = all answers were right)."""
    owner = {text: key for key, text in expected.items()}
    bad: list[str] = []
    for o in outcomes:
        allowed = timeline.allowed(o.adapter, o.t0, o.t1)
        where = f"{o.engine} {o.adapter} [{o.t0:.2f}, {o.t1:.2f}]"
        if o.status == 200:
            if o.text not in {expected[s] for s in allowed if s is not ABSENT}:
                bad.append(f"{where}: answered {o.text!r} (= {owner.get(o.text, 'unknown')}), allowed {allowed}")
        elif o.status == 404:
            if ABSENT not in allowed and not faults.during(o.engine, o.t0, o.t1):
                bad.append(f"{where}: 404 while the adapter was served: {o.error}")
        elif o.status is None:
            if not faults.during(o.engine, o.t0, o.t1):
                bad.append(f"{where}: no answer ({o.error}) from an engine nobody faulted")
        elif o.status != 503:
            bad.append(f"{where}: status {o.status}: {o.error}")
    return bad
