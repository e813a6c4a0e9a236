"""Whether a server stays live while it works: a request made while its /health is polled; where (on an
event loop's thread or not) an adapter config's regexes are matched."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest

from shared.regex import LinearRegex

# how long one /health may take while the server works on the request: far above a loaded host's answer
# (well under a second), far below the stall of a request that holds the event loop or the GIL for seconds
HEALTH_TIMEOUT_S = 5.0


@dataclass
class Polled:
    response: httpx.Response | None = None  # None: the request itself timed out
    seconds: float = 0.0  # how long the request took
    health: list[int | str] = field(default_factory=list)  # each /health poll's status, or "timeout"


def polling_health(base_url: str, request: Callable[[], httpx.Response]) -> Polled:
    """Run `request` on a thread, polling `base_url`/health (at most HEALTH_TIMEOUT_S each) until it ends,
    at least once."""
    polled = Polled()

    def run() -> None:
        start = time.perf_counter()
        with contextlib.suppress(httpx.TimeoutException):
            polled.response = request()
        polled.seconds = time.perf_counter() - start

    thread = threading.Thread(target=run, name="request-under-test")
    thread.start()
    with httpx.Client(base_url=base_url, timeout=HEALTH_TIMEOUT_S) as client:
        while True:  # one poll at least: a request quicker than the first poll had nothing to stall
            try:
                polled.health.append(client.get("/health").status_code)
            except httpx.TimeoutException:
                polled.health.append("timeout")
            if not thread.is_alive():
                break
            time.sleep(0.02)
    thread.join()
    return polled


def regex_matches_on_event_loop(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """From now on, one entry per match of a shared.regex pattern in this process: whether it ran on the
    thread of a running event loop (every server of this process answers on one)."""
    seen: list[bool] = []
    for name in ("fullmatch", "match"):
        real = getattr(LinearRegex, name)

        def recording(self: LinearRegex, text: str, real=real) -> object:  # noqa: ANN001
            try:
                asyncio.get_running_loop()
                seen.append(True)
            except RuntimeError:
                seen.append(False)
            return real(self, text)

        monkeypatch.setattr(LinearRegex, name, recording)
    return seen
