"""EngineCoreClient: the API process's handle on an engine-core process; implements EngineProtocol.

`from_config` starts the core process (threads.py decides its threads, CPUs and OpenMP policy), sends
it the config and waits for Ready: the finalized config, the vocabulary size, the first stats. Then
the API code uses it exactly as it used AsyncLLMEngine: `submit` checks one API request's engine
requests whole (admission.py) and sends them as one AddGroup, which the core adds whole (`generate`: a
group of one); each request's stream gets one RequestOutput per step that touched it; `abort`, `stats`
(as of the core's last message: never blocks), and the LoRA admin calls, answered in order after the
core ran them between two steps.

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
from dataclasses import fields

import zmq
import zmq.asyncio

from data_plane.config import EngineConfig
from data_plane.engine.admission import validate_request
from data_plane.engine.async_engine import settle
from data_plane.engine.core import messages as m
from data_plane.engine.core.host_copies import HostCopies
from data_plane.engine.core.process import SECRETS, CoreProcess
from data_plane.engine.llm_engine import EngineStats
from data_plane.engine.outputs import RequestOutput
from data_plane.engine.sequence import Request
from data_plane.engine.streams import RequestStream, Streams, SubmittingEngine
from data_plane.lora.weights import LoRAAdapterWeights
from data_plane.tokenizer import Tokenizer
from shared.errors import EngineDeadError, InvalidRequestError, LoraplaneError

logger = logging.getLogger(__name__)
SHUTDOWN_TIMEOUT_S = 30.0  # then the core is killed


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


class EngineCoreClient(SubmittingEngine):
    def __init__(self, config: EngineConfig, core: CoreProcess, ready: m.Ready) -> None:
        self.config = config
        assert config.tokenizer is not None  # EngineConfig.__post_init__ defaults it to the model
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer)
        self.vocab_size = ready.vocab_size
        self.healthy: bool = True
        self.dead_reason: str | None = None
        self.core = core
        self.pid = core.process.pid
        self._stats: EngineStats = ready.stats
        self._streams = Streams(config, self._stream_closed)
        self._calls: dict[int, asyncio.Future[None]] = {}
        self._call_ids = itertools.count()
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
    def submit(self, requests: list[Request]) -> list[RequestStream]:
        if not self.healthy:
            raise EngineDeadError(f"The engine is not running: {self.dead_reason}")
        for request in requests:
            validate_request(request, self.config, self.vocab_size)
        group = self._encode(m.AddGroup([
            m.AddRequest(r.request_id, r.prompt_token_ids, r.sampling_params, r.adapter_id, r.prefix_hash_seed,
                         r.group_id, r.grammar) for r in requests]))
        streams = self._streams.admit(requests, self._stats.num_waiting)
        acquired: list[int] = []
        try:  # no await from the admission to the send (see generation.py)
            for request in requests:  # their weights go first, on the same socket: the core has them in time
                if request.adapter_id:
                    self._host_copies.acquire(request.adapter_id, request.lora)
                    acquired.append(request.adapter_id)
        except BaseException:
            self._streams.withdraw(streams)
            for adapter_id in acquired:
                self._host_copies.release(adapter_id)
            raise
        self._send_encoded(group, "AddGroup")
        return streams

    def _stream_closed(self, stream: RequestStream) -> None:
        if stream.request.adapter_id:
            self._host_copies.release(stream.request.adapter_id)
        if not stream.finished:
            self.abort(stream.request.request_id)

    def abort(self, request_id: str) -> None:
        if self.healthy and not self._closed:
            self._send(m.Abort(request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def num_requests(self) -> int:
        return len(self._streams.open)

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
        self._send_encoded(self._encode(msg), type(msg).__name__)

    @staticmethod
    def _encode(msg: object) -> bytes:
        try:
            return m.encoder.encode(msg)
        except OverflowError:  # msgpack holds 64-bit integers; the API's schemas leave some unbounded
            raise InvalidRequestError("A number in the request is out of range (integers must fit in 64 bits, "
                                      "e.g. stop_token_ids, seed, max_tokens).") from None

    def _send_encoded(self, encoded: bytes, what: str) -> None:
        try:
            self.core.to_core.send(encoded, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # closed, or the core's side is gone: its exit is noticed on its own
            logger.warning("could not send %s to the engine core: %s", what, exc)

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
            self._streams.arrived(msg.admitted_seqs)
            for out in msg.outputs:
                stream = self._streams.open.get(out.request_id)
                if stream is not None:
                    client_error = out.client_error.to_exception() if out.client_error is not None else None
                    stream.queue.put_nowait(RequestOutput(
                        out.request_id, stream.request.prompt_token_ids, out.deltas, out.finished,
                        out.num_cached_tokens, out.error, client_error, out.first_token_steps))
        elif isinstance(msg, m.AdmissionFailed):
            self._streams.put(msg.request_id, msg.error.to_exception())
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
        self._streams.fail_all(exc)
        for future in self._calls.values():
            settle(future, None, exc)
