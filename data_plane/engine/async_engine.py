"""AsyncLLMEngine: runs the LLMEngine on its own thread so HTTP handlers never wait on a forward pass.

Handlers put request groups (admission.py: one API request's, checked whole) and aborts in an inbox;
the engine thread drains it between steps and hands each step's outputs back to the event loop in one
`call_soon_threadsafe`. A stream closed before its end (the client went away) aborts its request,
which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from data_plane.config import EngineConfig
from data_plane.engine.llm_engine import EngineStats, LLMEngine
from data_plane.engine.outputs import RequestOutput
from data_plane.engine.sequence import Request
from data_plane.engine.streams import RequestStream, Streams, SubmittingEngine
from data_plane.lora.weights import LoRAAdapterWeights
from shared.errors import EngineDeadError, LoraplaneError

logger = logging.getLogger(__name__)
T = TypeVar("T")
_LOOP_DIED = "the engine loop stopped unexpectedly; the engine's log has the cause"

# A call run on the engine thread: the function, its arguments, and the future its caller awaits (Any: the
# inbox holds calls of every result type; _call pairs each function with a future of its own result).
_Call = tuple[Callable[..., Any], tuple[object, ...], asyncio.Future[Any]]
# What the inbox holds, tagged by the first item: a request group to add, a call, a request id to abort.
_InboxItem = tuple[Literal["add"], list[Request]] | tuple[Literal["call"], _Call] | tuple[Literal["abort"], str]


def settle(future: asyncio.Future[Any], result: object, exc: BaseException | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


class AsyncLLMEngine(SubmittingEngine):
    """The engine the API serves from; implements data_plane.engine.protocol.EngineProtocol."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.vocab_size  # the model's: prompt token ids must be below it
        self.healthy: bool = True
        self.dead_reason: str | None = None
        self._inbox: queue.SimpleQueue[_InboxItem] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams = Streams(self.config, self._stream_closed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats = engine.stats()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        return cls(LLMEngine.from_config(config))

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
        await asyncio.to_thread(self.engine.shutdown)

    # ---- API side ------------------------------------------------------------------------------
    def submit(self, requests: list[Request]) -> list[RequestStream]:
        if not self.healthy:
            raise EngineDeadError(f"The engine is not running: {self.dead_reason}")
        for request in requests:
            self.engine.validate(request)
        streams = self._streams.admit(requests, self._stats.num_waiting)
        self._post(("add", requests))
        return streams

    def _stream_closed(self, stream: RequestStream) -> None:
        if not stream.finished:
            self.abort(stream.request.request_id)

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def num_requests(self) -> int:
        return len(self._streams.open)

    # ---- adapters: run on the engine thread between steps --------------------------------------
    async def pin_lora(self, adapter_id: int, weights: LoRAAdapterWeights) -> None:
        """Copy the adapter into a device slot now and keep it there until unpinned or removed."""
        await self._call(self.engine.pin_lora, adapter_id, weights)

    async def unpin_lora(self, adapter_id: int) -> None:
        await self._call(self.engine.unpin_lora, adapter_id)

    async def remove_lora(self, adapter_id: int) -> None:
        """Free the adapter's slot; the caller makes sure none of its requests is still in flight."""
        await self._call(self.engine.remove_lora, adapter_id)

    async def _call(self, fn: Callable[..., T], *args: object) -> T:
        if not self.healthy:
            raise EngineDeadError(f"The engine is not running: {self.dead_reason}")
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._post(("call", (fn, args, future)))
        return await future

    def _post(self, item: _InboxItem) -> None:
        self._inbox.put(item)
        self._wake.set()

    # ---- engine thread -------------------------------------------------------------------------
    @property
    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The API's event loop, which the engine thread hands results to: start() sets it first."""
        assert self._loop is not None, "the engine thread runs only after start()"
        return self._loop

    def _run(self) -> None:
        try:
            while not self._stopping:
                outputs, drained_seqs = self._drain_inbox()
                if self.engine.has_work():
                    outputs.extend(self._step())
                else:
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                self._stats = self.engine.stats()
                self._streams.arrived(drained_seqs)  # those sequences count in the stats' num_waiting now
                if outputs:
                    self._event_loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as exc:  # the loop itself broke: say so loudly and fail everyone
            logger.exception("engine loop died")
            # the exception's text may name a request or internals: /health and heartbeats get a
            # generic reason, the log above has the detail
            self.dead_reason = exc.message if isinstance(exc, EngineDeadError) else _LOOP_DIED
            self.healthy = False
            self._event_loop.call_soon_threadsafe(self._streams.fail_all, EngineDeadError(f"The engine died: {self.dead_reason}"))

    def _step(self) -> list[RequestOutput]:
        """One engine step. A batch's failure is handled inside step(); anything that escapes it
        (scheduling, bookkeeping) fails every request in flight, and the loop serves on."""
        try:
            return self.engine.step()
        except EngineDeadError:  # a tensor-parallel rank is gone: nothing can run any more
            raise
        except Exception as exc:
            logger.exception("engine step failed outside a batch; failing every request in flight")
            return self.engine.fail_all(exc)

    def _drain_inbox(self) -> tuple[list[RequestOutput], int]:
        """Outputs of the aborts, and how many sequences of added request groups left the inbox."""
        outputs: list[RequestOutput] = []
        drained_seqs = 0
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return outputs, drained_seqs
            if item[0] == "add":
                payload = item[1]
                drained_seqs += sum(r.sampling_params.n for r in payload)
                try:
                    self.engine.add_requests(payload)  # all or nothing: a refusal leaves nothing queued
                except Exception as exc:  # validated on the API side already; still never kill the loop
                    if not isinstance(exc, LoraplaneError):
                        logger.exception("admitting request %s failed", payload[0].request_id)
                        exc = LoraplaneError("The engine failed to admit the request.")
                    for request in payload:
                        self._event_loop.call_soon_threadsafe(self._streams.put, request.request_id, exc)
            elif item[0] == "call":
                fn, args, future = item[1]
                result, error = None, None
                try:
                    result = fn(*args)
                except Exception as exc:
                    error = exc
                self._stats = self.engine.stats()  # before the caller resumes: it sees its call's effect
                self._event_loop.call_soon_threadsafe(settle, future, result, error)
            elif item[0] == "abort":
                aborted = self.engine.abort_request(item[1])
                if aborted is not None:
                    outputs.append(aborted)

    # ---- back on the event loop ----------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._streams.put(output.request_id, output)
