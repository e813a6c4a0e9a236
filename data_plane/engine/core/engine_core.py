"""EngineCore: the step loop of the engine-core process, between two ZeroMQ sockets.

Between steps it drains the inbox (requests, aborts, adapter hand-overs, LoRA admin calls), then
runs one LLMEngine step and sends one StepOutputs message with every request's new output and the
stats after the step. Idle, it blocks on the inbox. The loop's own failures follow AsyncLLMEngine:
a failed batch fails its requests (inside step()), a failure outside a batch fails every request in
flight, a dead tensor-parallel rank (EngineDeadError) ends the loop with a Dead message.
"""

from __future__ import annotations

import logging
import threading

import zmq

from data_plane.adapters.loading.transfer import open_adapter
from data_plane.engine.core import messages as m
from data_plane.engine.llm_engine import LLMEngine
from data_plane.engine.outputs import RequestOutput
from data_plane.engine.sequence import Request
from data_plane.lora.weights import LoRAAdapterWeights
from shared.errors import EngineDeadError, LoraplaneError

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 500  # how often an idle core looks at its stop flag
_LOOP_DIED = "the engine loop stopped unexpectedly; the engine's log has the cause"


def _wire(output: RequestOutput) -> m.Output:
    client_error = m.WireError.of(output.client_error) if output.client_error is not None else None
    return m.Output(output.request_id, output.deltas, output.finished, output.num_cached_tokens,
                    output.error, client_error, output.first_token_steps)


def _wire_error(exc: Exception, what: str) -> m.WireError:
    if isinstance(exc, LoraplaneError):
        return m.WireError.of(exc)
    logger.error("%s failed", what, exc_info=exc)
    return m.WireError.of(LoraplaneError(f"The engine failed to {what}."))


class EngineCore:
    def __init__(self, engine: LLMEngine, inbox: zmq.Socket[bytes], outbox: zmq.Socket[bytes]) -> None:
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.stop = threading.Event()  # set by Shutdown, SIGTERM or the parent-watch thread
        self.adapters: dict[int, LoRAAdapterWeights] = {}  # host copies handed over by the client
        self.unmapped: dict[int, str] = {}  # adapters whose hand-over could not be mapped -> why
        self._poller = zmq.Poller()
        self._poller.register(inbox, zmq.POLLIN)

    def run(self) -> int:
        """Serve until told to stop; the process's exit code (0 clean, 1 the loop died)."""
        try:
            while not self.stop.is_set():
                busy = self.engine.has_work()
                outputs: list[m.Output] = []
                admitted = 0
                if self._poller.poll(0 if busy else IDLE_POLL_MS):
                    admitted = self._drain(outputs)
                if self.engine.has_work():
                    outputs.extend(_wire(o) for o in self._step())
                if outputs or admitted:
                    self._send(m.StepOutputs(outputs, self.engine.stats(), admitted))
            return 0
        except BaseException as exc:
            logger.exception("engine loop died")
            reason = exc.message if isinstance(exc, EngineDeadError) else _LOOP_DIED
            self._send(m.Dead(reason))
            return 1

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except EngineDeadError:
            raise
        except Exception as exc:
            logger.exception("engine step failed outside a batch; failing every request in flight")
            return self.engine.fail_all(exc)

    def _drain(self, outputs: list[m.Output]) -> int:
        """Handle every message waiting; returns how many sequences of added request groups it took."""
        admitted = 0
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return admitted
            msg = m.core_decoder.decode(frame.buffer)
            if isinstance(msg, m.AddGroup):
                admitted += sum(r.sampling_params.n for r in msg.requests)
                self._add(msg)
            elif isinstance(msg, m.Abort):
                aborted = self.engine.abort_request(msg.request_id)
                if aborted is not None:
                    outputs.append(_wire(aborted))
            elif isinstance(msg, m.ShipAdapter):
                self._open(msg)
            elif isinstance(msg, m.ForgetAdapter):
                self.adapters.pop(msg.adapter_id, None)
                self.unmapped.pop(msg.adapter_id, None)
            elif isinstance(msg, m.Call):
                self._call(msg, outputs)
            elif isinstance(msg, m.Shutdown):
                self.stop.set()
                return admitted

    def _open(self, msg: m.ShipAdapter) -> None:
        """Map the adapter's shared file; one that is gone (removed by someone else) refuses that adapter
        (its requests fail, the engine serves on) until it is handed over again or dropped."""
        try:
            self.adapters[msg.adapter_id] = open_adapter(msg.adapter)
            self.unmapped.pop(msg.adapter_id, None)
        except OSError as exc:
            logger.error("adapter %d: its host copy %s cannot be mapped (%s); its requests are refused",
                         msg.adapter_id, msg.adapter.file, exc)
            self.adapters.pop(msg.adapter_id, None)
            self.unmapped[msg.adapter_id] = exc.strerror or str(exc)

    def _weights(self, adapter_id: int) -> LoRAAdapterWeights | None:
        why = self.unmapped.get(adapter_id)
        if why is not None:
            raise LoraplaneError(f"The engine could not map adapter {adapter_id}'s weights ({why}); unload the "
                                 "adapter and load it again.")
        return self.adapters.get(adapter_id)

    def _add(self, msg: m.AddGroup) -> None:
        try:
            requests = [Request(r.request_id, r.prompt_token_ids, r.sampling_params, r.adapter_id, r.prefix_hash_seed,
                                self._weights(r.adapter_id) if r.adapter_id else None, r.group_id, r.grammar)
                        for r in msg.requests]
            self.engine.add_requests(requests)  # all or nothing: a refusal leaves nothing of the group queued
        except Exception as exc:
            error = _wire_error(exc, "admit the request")
            for r in msg.requests:
                self._send(m.AdmissionFailed(r.request_id, error))

    def _call(self, msg: m.Call, outputs: list[m.Output]) -> None:
        error = None
        try:
            if msg.method == "pin_lora":
                weights = self._weights(msg.adapter_id)
                if weights is None:
                    raise LoraplaneError(f"adapter {msg.adapter_id} was never handed to the engine core")
                self.engine.pin_lora(msg.adapter_id, weights)
            elif msg.method == "unpin_lora":
                self.engine.unpin_lora(msg.adapter_id)
            elif msg.method == "remove_lora":
                self.engine.remove_lora(msg.adapter_id)
                self.adapters.pop(msg.adapter_id, None)
                self.unmapped.pop(msg.adapter_id, None)
            else:
                raise LoraplaneError(f"unknown engine call {msg.method!r}")
        except Exception as exc:
            error = _wire_error(exc, msg.method.replace("_", " "))
        if outputs:  # what the drain produced so far goes first: the client sees messages in order
            self._send(m.StepOutputs(list(outputs), self.engine.stats(), 0))
            outputs.clear()
        self._send(m.CallResult(msg.call_id, error, self.engine.stats()))

    def _send(self, msg: object) -> None:
        self.outbox.send(m.encoder.encode(msg), copy=False)
