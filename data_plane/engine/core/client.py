"""EngineCoreClient: the API process's handle on an engine-core process; implements EngineProtocol.

`from_config` starts the core process (threads.py decides its threads, CPUs and OpenMP policy), sends
it the config and waits for Ready: the finalized config, the vocabulary size, the first stats. Then
the API code uses it exactly as it used AsyncLLMEngine: `generate` yields one RequestOutput per step
that touched the request, `abort`, `stats` (as of the core's last message: never blocks), and the
LoRA admin calls, answered in order after the core ran them between two steps.

One receive task on the event loop takes the core's messages (one per step, carrying every request's
new output), so the loop wakes once per step, and each request's waiter once per step. A core that
dies (exit, kill, a dead tensor-parallel rank) fails every request in flight and every pending call
with EngineDeadError and turns `healthy` False (/health then answers 503); nothing waits on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import subprocess
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass, fields

import zmq
import zmq.asyncio

from data_plane.config import EngineConfig
from data_plane.engine.async_engine import check_admission, settle, until_finished
from data_plane.engine.core import messages as m
from data_plane.engine.core.host_copies import HostCopies
from data_plane.engine.core.process import SECRETS, CoreProcess
from data_plane.engine.llm_engine import EngineStats
from data_plane.engine.outputs import RequestOutput
from data_plane.engine.sequence import Request
from data_plane.lora.weights import LoRAAdapterWeights
from data_plane.tokenizer import Tokenizer
from shared.errors import EngineDeadError, InvalidRequestError, LoraplaneError

logger = logging.getLogger(__name__)
SHUTDOWN_TIMEOUT_S = 30.0  # then the core is killed


@dataclass
class _Stream:
    queue: asyncio.Queue[RequestOutput | Exception]
    prompt_token_ids: list[int]  # sent to the core once; every output carries them again from here


def _wait_ready(core: CoreProcess) -> m.Ready:
    while True:
        if core.from_core.poll(200):
            msg = m.client_decoder.decode(core.from_core.recv())
            if isinstance(msg, m.StartFailed):
                with contextlib.suppress(subprocess.TimeoutExpired):  # it exits on its own; else it is killed
                    core.process.wait(30)
                raise msg.error.to_exception()
            assert isinstance(msg, m.Ready), msg
            return msg
        code = core.process.poll()
        if code is not None:
            raise EngineDeadError(f"the engine-core process exited with code {code} while loading the model; "
                                  "its log above has the cause")


class EngineCoreClient:
    def __init__(self, config: EngineConfig, core: CoreProcess, ready: m.Ready) -> None:
        self.config = config
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer)
        self.vocab_size = ready.vocab_size
        self.healthy: bool = True
        self.dead_reason: str | None = None
        self.core = core
        self.pid = core.process.pid
        self._stats: EngineStats = ready.stats
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, asyncio.Future[None]] = {}
        self._call_ids = itertools.count()
        self._queued_seqs = 0  # sent and not yet taken from the core's inbox (not in stats.num_waiting)
        self._host_copies = HostCopies(config.max_cpu_loras or 1, self._send)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._receiver: asyncio.Task[None] | None = None
        self._stopping = False
        self._closed = False

    @classmethod
    def from_config(cls, config: EngineConfig, core: CoreProcess | None = None) -> EngineCoreClient:
        """Start the core (or take one CoreProcess.spawn started for this config), load the model
        there (slow), finalize `config` with what the model says."""
        core = core or CoreProcess.spawn(config)
        try:
            ready = _wait_ready(core)
        except BaseException:
            core.kill()
            core.close()
            raise
        for f in fields(config):  # the model-dependent defaults the core filled in (max_model_len, …)
            if getattr(config, f.name) is None and f.name not in SECRETS and f.name != "num_threads":
                setattr(config, f.name, getattr(ready.config, f.name))
        return cls(config, core, ready)

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._receiver = self._loop.create_task(self._receive(zmq.asyncio.Socket.from_socket(self.core.from_core)))
        threading.Thread(target=self._watch, name="engine-core-watch", daemon=True).start()

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._stopping = True
        if self.core.process.poll() is None:
            self._send(m.Shutdown())
            try:
                await asyncio.to_thread(self.core.process.wait, SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.error("the engine core did not stop within %.0fs; killing it", SHUTDOWN_TIMEOUT_S)
                self.core.kill()
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver
        self._fail_all(EngineDeadError("The engine was shut down."))
        self._closed = True
        self.core.close()

    # ---- API side ------------------------------------------------------------------------------
    async def generate(self, request: Request) -> AsyncGenerator[RequestOutput, None]:
        if not self.healthy:
            raise EngineDeadError(f"The engine is not running: {self.dead_reason}")
        check_admission(request, self._stats.num_waiting + self._queued_seqs, self.config, self._streams)
        stream = _Stream(asyncio.Queue(), request.prompt_token_ids)
        self._streams[request.request_id] = stream
        adapter_id = request.adapter_id
        finished = False
        try:
            if adapter_id:
                self._host_copies.acquire(adapter_id, request.lora)  # no await before the send (see generation.py)
            self._queued_seqs += request.sampling_params.n
            self._send(m.AddRequest(request.request_id, request.prompt_token_ids, request.sampling_params,
                                    adapter_id, request.prefix_hash_seed))
            async for item in until_finished(stream.queue):
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request.request_id, None)
            if adapter_id:
                self._host_copies.release(adapter_id)
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        if self.healthy and not self._closed:
            self._send(m.Abort(request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def num_requests(self) -> int:
        return len(self._streams)

    async def pin_lora(self, adapter_id: int, weights: LoRAAdapterWeights) -> None:
        """Copy the adapter into a device slot now and keep it there until unpinned or removed."""
        self._host_copies.ensure(adapter_id, weights)
        await self._call("pin_lora", adapter_id)

    async def unpin_lora(self, adapter_id: int) -> None:
        await self._call("unpin_lora", adapter_id)

    async def remove_lora(self, adapter_id: int) -> None:
        """Free the adapter's slot and the core's host copy; none of its requests is still in flight."""
        await self._call("remove_lora", adapter_id)
        self._host_copies.forget(adapter_id)

    async def _call(self, method: str, adapter_id: int) -> None:
        if not self.healthy:
            raise EngineDeadError(f"The engine is not running: {self.dead_reason}")
        call_id = next(self._call_ids)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(m.Call(call_id, method, adapter_id))
        try:
            await future
        finally:
            self._calls.pop(call_id, None)

    def _send(self, msg: object) -> None:
        try:
            encoded = m.encoder.encode(msg)
        except OverflowError:  # msgpack holds 64-bit integers; the API's schemas leave some unbounded
            raise InvalidRequestError("A number in the request is out of range (integers must fit in 64 bits, "
                                      "e.g. stop_token_ids, seed, max_tokens).") from None
        try:
            self.core.to_core.send(encoded, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # closed, or the core's side is gone: its exit is noticed on its own
            logger.warning("could not send %s to the engine core: %s", type(msg).__name__, exc)

    # ---- the core's messages, on the event loop ------------------------------------------------
    async def _receive(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frame = await sock.recv(copy=False)
            try:
                self._handle(m.client_decoder.decode(frame.buffer))
            except Exception:  # a bad message must not stop the deliveries of every other request
                logger.exception("handling a message of the engine core failed")

    def _handle(self, msg: m.ToClient) -> None:
        if isinstance(msg, m.StepOutputs):
            self._stats = msg.stats
            self._queued_seqs -= msg.admitted_seqs
            for out in msg.outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    client_error = out.client_error.to_exception() if out.client_error is not None else None
                    stream.queue.put_nowait(RequestOutput(
                        out.request_id, stream.prompt_token_ids, out.deltas, out.finished,
                        out.num_cached_tokens, out.error, client_error))
        elif isinstance(msg, m.AdmissionFailed):
            stream = self._streams.get(msg.request_id)
            if stream is not None:
                stream.queue.put_nowait(msg.error.to_exception())
        elif isinstance(msg, m.CallResult):
            self._stats = msg.stats
            future = self._calls.get(msg.call_id)
            if future is not None:
                settle(future, None, msg.error.to_exception() if msg.error is not None else None)
        elif isinstance(msg, m.Dead):
            self._die(msg.reason)

    def _watch(self) -> None:
        code = self.core.process.wait()
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to tell
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._core_exited, code)

    def _core_exited(self, code: int) -> None:
        if not self._stopping:
            logger.error("the engine-core process %d exited with code %d", self.pid, code)
            self._die(f"the engine-core process exited (code {code})")

    def _die(self, reason: str) -> None:
        if not self.healthy:
            return
        self.healthy = False
        self.dead_reason = reason
        self._fail_all(EngineDeadError(f"The engine died: {reason}"))

    def _fail_all(self, exc: LoraplaneError) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(exc)
        for future in self._calls.values():
            settle(future, None, exc)
