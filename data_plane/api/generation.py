"""One engine request in flight, as the serving layer sees it.

`start_generation` submits a Request and waits for its first output, so that what the engine
refuses on admission (400 prompt too long, 503 overloaded, engine dead) becomes an HTTP error
before any byte of a response — streamed or not — has been sent. `Generation` then yields the
remaining outputs, records the request's metrics, and is always closed: closing it closes the
engine's generator, which aborts the request and frees its KV blocks if it had not finished, and
releases the request's adapter lease — exactly once, however the request ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

import anyio

from data_plane.engine.outputs import RequestOutput
from data_plane.engine.protocol import EngineProtocol
from data_plane.engine.sequence import FinishReason, Request
from data_plane.lora.entry import Lease
from data_plane.metrics import RequestMetrics
from shared.errors import EngineDeadError, LoraplaneError, OverloadedError

logger = logging.getLogger(__name__)

EngineStream = AsyncGenerator[RequestOutput, None]


class Generation:
    def __init__(
        self,
        request_id: str,
        stream: EngineStream,
        first: RequestOutput,
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
        self._metrics.on_output(sum(len(d.token_ids) for d in output.deltas))
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
    """Submit `request` and wait for its first output; engine refusals raise here. The Generation
    owns `lease` from here on; if the request is refused, the lease is released before raising."""
    stream = engine.generate(request)
    try:
        if lease is not None:
            # no await between this check and the submission (the generator's first step): an unload
            # that aborted the adapter's requests cannot slip a new one past it
            lease.check_admissible()
        first = await anext(stream)
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            await stream.aclose()
        metrics.finish(_outcome_of(exc))
        if lease is not None:
            lease.release()
        if isinstance(exc, StopAsyncIteration):
            raise EngineDeadError("The engine ended the request without any output.") from None
        raise
    metrics.admitted(len(request.prompt_token_ids))
    return Generation(request.request_id, stream, first, metrics, lease)


def _outcome_of(exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "abort"
    if isinstance(exc, OverloadedError) or (isinstance(exc, LoraplaneError) and exc.status_code < 500):
        return "rejected"  # refused on admission: the request never ran
    return "error"


async def start_all(
    engine: EngineProtocol, requests: list[tuple[Request, RequestMetrics, Lease | None]]
) -> list[Generation]:
    """Start several requests concurrently (a batched prompt); if one is refused, close the others."""
    results = await asyncio.gather(
        *(start_generation(engine, r, m, lease) for r, m, lease in requests), return_exceptions=True
    )
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for r in results:
            if isinstance(r, Generation):
                await r.aclose()
        raise errors[0]
    return list(results)  # type: ignore[arg-type]


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
