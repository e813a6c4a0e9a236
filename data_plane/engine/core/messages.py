"""The wire between the API process and the engine-core process: msgspec Structs, msgpack-encoded.

One socket each way (ZeroMQ PUSH/PULL, so messages arrive in the order sent):

    client → core:  (config, log level) once (process.py), then AddGroup, Abort, ShipAdapter, ForgetAdapter, Call, Shutdown
    core → client:  Ready | StartFailed (once), StepOutputs (one per step: every request's new
                    tokens, the stats after it), AdmissionFailed, CallResult, Dead

Prompt token ids go to the core once (AddGroup) and never come back: the client keeps them and
rebuilds each RequestOutput. Errors cross as WireError and are raised again as the same
LoraplaneError class on the other side; anything else is logged where it happened and crosses as a
generic LoraplaneError, so internals never reach a client.
"""

from __future__ import annotations

import msgspec

from data_plane.adapters.loading.transfer import SharedAdapter
from data_plane.config import EngineConfig
from data_plane.engine.llm_engine import EngineStats
from data_plane.engine.outputs import CompletionDelta
from data_plane.engine.sampling_params import SamplingParams
from data_plane.lora import errors as _lora_errors  # noqa: F401  (its error classes must be known to from_wire)
from shared.errors import LoraplaneError


class WireError(msgspec.Struct, array_like=True):
    kind: str  # the LoraplaneError subclass's name
    message: str
    param: str | None = None
    code: str | int | None = None

    @classmethod
    def of(cls, exc: LoraplaneError) -> WireError:
        return cls(type(exc).__name__, exc.message, exc.param, exc.code)

    def to_exception(self) -> LoraplaneError:
        error_class = _error_classes().get(self.kind, LoraplaneError)
        exc = error_class.__new__(error_class)  # subclasses may take other constructor arguments
        LoraplaneError.__init__(exc, self.message, param=self.param, code=self.code)  # type: ignore[arg-type]
        return exc


def _error_classes() -> dict[str, type[LoraplaneError]]:
    found: dict[str, type[LoraplaneError]] = {"LoraplaneError": LoraplaneError}
    pending = [LoraplaneError]
    while pending:
        for sub in pending.pop().__subclasses__():
            found.setdefault(sub.__name__, sub)
            pending.append(sub)
    return found


# ---- client → core ----------------------------------------------------------------------------------
class AddRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    adapter_id: int
    prefix_hash_seed: int
    group_id: str = ""  # Request.group_id
    grammar: str | None = None  # Request.grammar


class AddGroup(msgspec.Struct, tag=True, array_like=True):
    """The engine requests of one API request: the core adds all of them or none."""

    requests: list[AddRequest]


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_id: str


class ShipAdapter(msgspec.Struct, tag=True, array_like=True):
    """An adapter's host copy handed to the core: its shared file's layout (adapters/loading/transfer.py)."""

    adapter_id: int
    adapter: SharedAdapter


class ForgetAdapter(msgspec.Struct, tag=True, array_like=True):
    """Drop the core's host copy (the client keeps at most max_cpu_loras there); a slot keeps its own."""

    adapter_id: int


class Call(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    method: str  # "pin_lora" | "unpin_lora" | "remove_lora"
    adapter_id: int


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


ToCore = AddGroup | Abort | ShipAdapter | ForgetAdapter | Call | Shutdown


# ---- core → client ----------------------------------------------------------------------------------
class Ready(msgspec.Struct, tag=True, array_like=True):
    config: EngineConfig  # finalized for the model: max_model_len and the other model-dependent defaults
    vocab_size: int
    stats: EngineStats


class StartFailed(msgspec.Struct, tag=True, array_like=True):
    error: WireError


class Output(msgspec.Struct, array_like=True):
    request_id: str
    deltas: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int
    error: str | None = None
    client_error: WireError | None = None
    first_token_steps: int | None = None


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[Output]
    stats: EngineStats
    admitted_seqs: int  # sequences of AddGroups taken from the inbox since the last message


class AdmissionFailed(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    error: WireError


class CallResult(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    error: WireError | None
    stats: EngineStats  # after the call: the caller sees its effect


class Dead(msgspec.Struct, tag=True, array_like=True):
    reason: str  # generic (the core's log has the detail)


ToClient = Ready | StartFailed | StepOutputs | AdmissionFailed | CallResult | Dead

encoder = msgspec.msgpack.Encoder()
core_decoder = msgspec.msgpack.Decoder(ToCore)
client_decoder = msgspec.msgpack.Decoder(ToClient)
