"""The API side of an engine: the output streams of the requests it submitted, and the group admission.

Both engines (AsyncLLMEngine, and EngineCoreClient for the engine-core process) hand each submitted
request a RequestStream, which their loop fills with the request's outputs, and keep the count of the
sequences on their way to the engine's waiting queue (posted, not yet taken from its inbox), which the
admission check (admission.py) adds to the waiting queue of the engine's last stats.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable

from data_plane.config import EngineConfig
from data_plane.engine.admission import check_group
from data_plane.engine.outputs import RequestOutput
from data_plane.engine.sequence import Request


class RequestStream:
    """One submitted request's outputs, up to the finished one; an exception its engine puts there is
    raised. Close it always, started or not: closing it before the finished output aborts the request."""

    def __init__(self, request: Request, on_close: Callable[[RequestStream], None]) -> None:
        self.request = request
        self.queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self.finished = False  # the finished output came: nothing to abort
        self._done = False
        self._closed = False
        self._on_close = on_close

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, Exception):
            self._done = True
            raise item
        if item.finished:
            self._done = self.finished = True
        return item

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._on_close(self)


class Streams:
    """The requests submitted and not yet closed (by id), and their sequences not yet in the waiting queue."""

    def __init__(self, config: EngineConfig, on_close: Callable[[RequestStream], None]) -> None:
        self.config = config
        self.open: dict[str, RequestStream] = {}
        self._on_close = on_close
        self._in_transit = 0  # sequences posted to the engine and not yet taken from its inbox
        self._lock = threading.Lock()  # AsyncLLMEngine's loop thread counts the ones it takes

    def admit(self, requests: list[Request], num_waiting: int) -> list[RequestStream]:
        """Check the group against the waiting queue (`num_waiting` as of the last step) and the limits
        (admission.py: raises, registering nothing), then register a stream per request."""
        seqs = check_group(requests, num_waiting + self._in_transit, self.config, self.open)
        with self._lock:
            self._in_transit += seqs
        streams = [RequestStream(r, self._close) for r in requests]
        self.open.update((s.request.request_id, s) for s in streams)
        return streams

    def withdraw(self, streams: list[RequestStream]) -> None:
        """The group was admitted here but never sent: forget it."""
        self.arrived(sum(s.request.sampling_params.n for s in streams))
        for stream in streams:
            self.open.pop(stream.request.request_id, None)

    def arrived(self, seqs: int) -> None:
        """The engine took that many sequences from its inbox: its stats' num_waiting counts them now."""
        with self._lock:
            self._in_transit -= seqs

    def put(self, request_id: str, item: RequestOutput | Exception) -> None:
        stream = self.open.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(item)

    def fail_all(self, exc: Exception) -> None:
        for stream in self.open.values():
            stream.queue.put_nowait(exc)

    def _close(self, stream: RequestStream) -> None:
        if self.open.get(stream.request.request_id) is stream:
            del self.open[stream.request.request_id]
            self._on_close(stream)


class SubmittingEngine:
    """`generate` for an engine whose `submit` admits groups: a group of one, as an async generator."""

    def submit(self, requests: list[Request]) -> list[RequestStream]:
        raise NotImplementedError

    async def generate(self, request: Request) -> AsyncGenerator[RequestOutput, None]:
        [stream] = self.submit([request])
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()
