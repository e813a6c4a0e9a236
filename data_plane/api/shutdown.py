"""Graceful shutdown of an engine: on SIGTERM stop admitting, tell the control plane, let in-flight finish.

uvicorn on its own would close the listening socket at once (new clients: connection refused, which a
router or a retrying client cannot tell from a crash) and then cancel whatever is still running after
`timeout_graceful_shutdown`. A process manager's SIGTERM means "finish what you have, take nothing new",
so the engine does that in three steps before letting uvicorn shut down:

1. `AdmissionGate` (an ASGI wrapper around the app) closes: new inference requests and adapter loads get
   503 `service_unavailable` with a message that says the engine is shutting down, and /health answers 503
   so that load balancers stop sending; everything else (listings, unloads, metrics) keeps working;
2. `on_drain` is awaited (the control plane's `POST /v1/engines/{name}/drain`: no new placements here);
3. requests already admitted run to completion, for at most `shutdown_timeout_s` seconds;

then uvicorn's own shutdown runs (connections closed, lifespan shutdown, engine stopped). A second
SIGTERM or SIGINT skips the wait.

Once stopped, uvicorn raises the signal again with the handler it found. The default one would end the
process there, before its exit handlers run, and the adapters' host copies (shared-memory files removed
by finalizers, data_plane/adapters/loading/shared_tensors.py) would stay in /dev/shm until the next
engine sweeps them; `exit_through_python` makes that handler a SystemExit with the shell's status for the signal.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import uvicorn

from shared.errors import OverloadedError

logger = logging.getLogger(__name__)

# Paths whose requests are refused once the gate is closed; the in-flight count covers these only.
ADMITTING = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter"})
HEALTH = "/health"
DRAIN_CALL_TIMEOUT_S = 10.0
SHUTTING_DOWN = "The engine is shutting down and admits no new requests; retry on another engine."

Asgi = Callable[..., Awaitable[None]]


class AdmissionGate:
    """ASGI wrapper: counts requests to ADMITTING paths while open, answers 503 to them once closed."""

    def __init__(self, app: Asgi) -> None:
        self.app = app
        self.closed = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def close(self) -> None:
        self.closed = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when every admitted request has finished, False when `timeout_s` ran out first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def __call__(self, scope: dict[str, Any], receive: Asgi, send: Asgi) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or (path not in ADMITTING and path != HEALTH):
            await self.app(scope, receive, send)
            return
        if self.closed:
            await _refuse(send)
            return
        if path == HEALTH:
            await self.app(scope, receive, send)
            return
        self.in_flight += 1
        self._idle.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()


async def _refuse(send: Asgi) -> None:
    body = json.dumps(OverloadedError(SHUTTING_DOWN, code="shutting_down").to_body()).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def exit_through_python() -> None:
    """SIGTERM and SIGINT, when not caught by a server, exit with status 128 + signal through Python's
    own exit, so that exit handlers and finalizers run (the default handlers skip them)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_for_signal)


def _exit_for_signal(sig: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + sig)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains (see the module docstring) before exiting."""

    def __init__(self, config: uvicorn.Config, gate: AdmissionGate, *, shutdown_timeout_s: float,
                 on_drain: Callable[[], Awaitable[object]] | None = None) -> None:
        super().__init__(config)
        self.gate = gate
        self.shutdown_timeout_s = shutdown_timeout_s
        self.on_drain = on_drain
        self._drain_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the signal handler, on the loop's own thread, between two of its callbacks.
        if self._drain_task is not None or self._loop is None or self.should_exit or not self.started:
            super().handle_exit(sig, frame)  # a second signal, or one before serving: exit now
            return
        self._captured_signals.append(sig)  # re-raised after the shutdown, as uvicorn does
        self._drain_task = self._loop.create_task(self.drain(signal.Signals(sig).name))

    async def drain(self, reason: str) -> None:
        started = time.monotonic()
        self.gate.close()
        logger.info("%s: draining (admits nothing new; %d in flight; up to %.0fs)", reason, self.gate.in_flight,
                    self.shutdown_timeout_s)
        if self.on_drain is not None:
            try:
                await asyncio.wait_for(self.on_drain(), DRAIN_CALL_TIMEOUT_S)
            except Exception as exc:  # the control plane down must not keep the engine from stopping
                logger.warning("could not tell the control plane about the drain: %s", type(exc).__name__)
        left = max(0.0, self.shutdown_timeout_s - (time.monotonic() - started))
        if not await self.gate.wait_idle(left):
            logger.warning("shutdown timeout: %d request(s) still in flight are aborted", self.gate.in_flight)
        self.should_exit = True
