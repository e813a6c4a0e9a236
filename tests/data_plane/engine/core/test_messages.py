"""The wire: every message survives msgpack both ways, errors come back as their own class."""

from __future__ import annotations

from data_plane.engine.core import messages as m
from data_plane.engine.outputs import CompletionDelta
from data_plane.engine.sampling_params import SamplingParams
from data_plane.lora.errors import LoRAConflictError
from data_plane.lora.slots import AdapterEngineStats, LoRAEngineStats
from shared.errors import InvalidRequestError, LoraplaneError, OverloadedError
from tests.data_plane.api.engines import engine_stats


def test_a_group_of_requests_and_their_sampling_parameters_cross_unchanged():
    params = SamplingParams(n=2, max_tokens=7, temperature=0.5, top_k=3, seed=-5, stop=["\n"], logprobs=2)
    msg = m.AddGroup([m.AddRequest("r1", [1, 2, 3], params, adapter_id=4, prefix_hash_seed=2**63 + 1, group_id="g"),
                      m.AddRequest("r2", [4], params, adapter_id=0, prefix_hash_seed=0, group_id="g")])
    assert m.core_decoder.decode(m.encoder.encode(msg)) == msg


def test_a_step_carries_deltas_logprobs_and_the_stats():
    lora = LoRAEngineStats(slots_total=4, slots_used=1, adapters={3: AdapterEngineStats(slot=0, pinned=True, loads=2)})
    stats = engine_stats(lora, num_running=2, num_waiting=1)
    stats.step_adapters = {0: 3, 1: 9}
    delta = CompletionDelta(0, "hé", [5, 6], [{5: -0.25, 9: -1.5}, {6: -0.5}], "stop", stop_reason=7)
    msg = m.StepOutputs([m.Output("r1", [delta], True, 16, first_token_steps=3)], stats, admitted_seqs=2)
    back = m.client_decoder.decode(m.encoder.encode(msg))
    assert back == msg and back.outputs[0].deltas[0].logprobs[0] == {5: -0.25, 9: -1.5}
    assert back.stats.lora.adapters[3].pinned and back.stats.step_adapters == {0: 3, 1: 9}


def test_errors_come_back_as_the_same_class_with_their_fields():
    for exc in (OverloadedError("full"), InvalidRequestError("bad", param="prompt", code="context_length_exceeded"),
                LoRAConflictError("every slot", param="lora_name")):
        wire = m.client_decoder.decode(m.encoder.encode(m.AdmissionFailed("r", m.WireError.of(exc)))).error
        back = wire.to_exception()
        assert type(back) is type(exc) and back.status_code == exc.status_code
        assert back.to_body() == exc.to_body()


def test_an_unknown_error_kind_is_a_plain_internal_error():
    back = m.WireError("NoSuchError", "x").to_exception()
    assert type(back) is LoraplaneError and back.status_code == 500
