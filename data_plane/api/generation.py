"""One engine request in flight, as the serving layer sees it.

`start_all` submits the engine Requests of one API request (a completion's prompts) together: the
engine admits them whole or refuses them whole (400 can never fit, 503 not now, engine dead) before
any of them reaches its core, and the core adds them whole. It then waits for the first output of
the first, so that a refusal becomes an HTTP error before any byte of a response (streamed or not)
has been sent. `Generation` then yields the outputs, records the request's metrics, and is always
closed: closing it closes the engine's stream, which aborts the request and frees its KV blocks if
it had not finished, and releases the request's adapter lease, exactly once, however it ended.
"""

from __future__ import annotations

import asyncio
import logging

import anyio

from data_plane.adapters.entry import Lease
from data_plane.engine.outputs import RequestOutput
from data_plane.engine.protocol import EngineProtocol
from data_plane.engine.sequence import FinishReason, Request
from data_plane.engine.streams import RequestStream
from data_plane.metrics import RequestMetrics
from shared.errors import EngineDeadError, LoraplaneError, OverloadedError

logger = logging.getLogger(__name__)


class Generation:
    def __init__(
        self,
        request_id: str,
        stream: RequestStream,
        first: RequestOutput | None,
        metrics: RequestMetrics,
        lease: Lease | None = None,
    ) -> None:
        self.request_id = request_id
        self._stream = stream
        self._pending: RequestOutput | None = first
        self._metrics = metrics
        self._lease = lease
        self._done = False
        self._closed = False
        self._outcome: str | None = None  # None when closed early: the request was aborted

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            if self._pending is not None:
                output, self._pending = self._pending, None
            else:
                output = await anext(self._stream)
        except StopAsyncIteration:  # the engine ended the stream without a finished output
            self._done, self._outcome = True, "error"
            raise EngineDeadError("The engine ended the request without finishing it.") from None
        except Exception:
            self._done, self._outcome = True, "error"
            raise
        self._metrics.on_output(sum(len(d.token_ids) for d in output.deltas), output.first_token_steps)
        if self._lease is not None and (error := _unloaded_error(output, self._lease)) is not None:
            self._done, self._outcome = True, "abort"  # its adapter was unloaded: say so, not "finished"
            raise error
        if output.client_error is not None:  # the engine refused it for a reason the client should read
            self._done, self._outcome = True, "error"
            raise output.client_error
        if output.error:  # the engine failed the request (its batch crashed): no partial answer
            self._done, self._outcome = True, "error"
            # the engine's message names internals (exception types, device errors): log it, don't send it
            logger.warning("request %s failed in the engine: %s", self.request_id, output.error)
            raise LoraplaneError("The engine failed to process the request.")
        if output.finished:
            self._done, self._outcome = True, "ok"
        return output

    async def aclose(self) -> None:
        """Idempotent; safe inside a cancelled scope (the abort must reach the engine)."""
        if self._closed:
            return
        self._closed = True
        try:
            with anyio.CancelScope(shield=True):
                await self._stream.aclose()  # unfinished: the engine aborts it and frees its KV blocks
            self._metrics.finish(self._outcome or "abort")
        finally:
            if self._lease is not None:
                self._lease.release()  # after the engine let go: an unload may then free the slot


def _unloaded_error(output: RequestOutput, lease: Lease) -> LoraplaneError | None:
    """The unload of this request's adapter timed out and aborted it: the error the client gets."""
    error = lease.abort_error
    if error is None or not output.finished:
        return None
    aborted = not output.deltas or any(d.finish_reason == FinishReason.ABORT for d in output.deltas)
    return error if aborted else None


async def start_generation(
    engine: EngineProtocol, request: Request, metrics: RequestMetrics, lease: Lease | None = None
) -> Generation:
    """`start_all` of one request."""
    [generation] = await start_all(engine, [(request, metrics, lease)])
    return generation


async def start_all(
    engine: EngineProtocol, requests: list[tuple[Request, RequestMetrics, Lease | None]]
) -> list[Generation]:
    """Submit the engine requests of one API request and wait for the first output of the first; engine
    refusals raise here. The Generations own the leases from here on; if the requests are refused, the
    leases are released before raising."""
    try:
        for _, _, lease in requests:
            if lease is not None:
                # no await between this check and the submission: an unload that aborted the adapter's
                # requests cannot slip a new one past it
                lease.check_admissible()
        streams = engine.submit([request for request, _, _ in requests])
    except BaseException as exc:
        _refused(requests, exc)
        raise
    try:
        # the engine's core adds the group whole or refuses it whole: the first stream's first item says which
        first = await anext(streams[0])
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            for stream in streams:
                await stream.aclose()
        _refused(requests, exc)
        if isinstance(exc, StopAsyncIteration):
            raise EngineDeadError("The engine ended the request without any output.") from None
        raise
    generations = []
    for index, ((request, metrics, lease), stream) in enumerate(zip(requests, streams, strict=True)):
        metrics.admitted(len(request.prompt_token_ids))
        generations.append(Generation(request.request_id, stream, first if index == 0 else None, metrics, lease))
    return generations


def _refused(requests: list[tuple[Request, RequestMetrics, Lease | None]], exc: BaseException) -> None:
    for _, metrics, lease in requests:
        metrics.finish(_outcome_of(exc))
        if lease is not None:
            lease.release()


def _outcome_of(exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "abort"
    if isinstance(exc, OverloadedError) or (isinstance(exc, LoraplaneError) and exc.status_code < 500):
        return "rejected"  # refused on admission: the request never ran
    return "error"


class MergedGenerations:
    """Outputs of several generations as they arrive, tagged with the generation's index."""

    def __init__(self, generations: list[Generation]) -> None:
        self.generations = generations
        self._tasks: dict[asyncio.Task[RequestOutput], int] = {}
        self._started = False

    def __aiter__(self) -> MergedGenerations:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if len(self.generations) == 1:  # one prompt: no task and no wait() per output, just its next one
            return 0, await anext(self.generations[0])
        if not self._started:
            self._started = True
            for i in range(len(self.generations)):
                self._schedule(i)
        while self._tasks:
            done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
            task = done.pop()
            index = self._tasks.pop(task)
            try:
                output = task.result()
            except StopAsyncIteration:
                continue
            self._schedule(index)
            return index, output
        raise StopAsyncIteration

    def _schedule(self, index: int) -> None:
        self._tasks[asyncio.ensure_future(anext(self.generations[index]))] = index

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._tasks.clear()
            for generation in self.generations:
                await generation.aclose()
