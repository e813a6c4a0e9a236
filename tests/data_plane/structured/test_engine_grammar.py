"""Structured outputs in the engine, driven step by step on the demo checkpoint (float32, CPU): constrained
greedy tokens against transformers' logits masked by llguidance (tests/data_plane/structured/oracle.py),
unconstrained neighbours untouched, preemption, a grammar's dead end; and the compile timeout's 400."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from litestar.testing import TestClient

from data_plane.api.app import create_app
from data_plane.engine.sampling_params import SamplingParams, StructuredOutputsParams
from data_plane.engine.sequence import Request
from data_plane.tokenizer import Tokenizer
from shared.errors import InvalidRequestError
from tests.data_plane.api.engines import SERVED
from tests.data_plane.api.engines import make_engine as make_async_engine
from tests.data_plane.engine.conftest import make_engine, run
from tests.data_plane.structured.oracle import (
    DEAD_END,
    MAX_TOKENS,
    PROMPTS,
    SCHEMA,
    constrained_greedy,
    json_grammar,
)


def constrained(**fields: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                          structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA)), **fields)


def unconstrained() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(demo_model_dir: Path) -> list[list[int]]:
    return [constrained_greedy(demo_model_dir, p, json_grammar(SCHEMA), MAX_TOKENS) for p in PROMPTS]


def decode_json(model_dir: Path, tokens: list[int]) -> dict:
    return json.loads(Tokenizer.from_pretrained(model_dir).decode(tokens))


def test_constrained_greedy_matches_the_oracle_and_neighbours_are_untouched(demo_model_dir, expected):
    engine = make_engine(demo_model_dir)
    plain_alone = run(engine, PROMPTS, unconstrained())
    # every step batches constrained and unconstrained rows together
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(Request(f"c{i}", list(prompt), constrained()))
        engine.add_request(Request(f"u{i}", list(prompt), unconstrained()))
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str | None] = {}
    while engine.has_work():
        for output in engine.step():
            for d in output.deltas:
                tokens.setdefault(output.request_id, []).extend(d.token_ids)
                finish[output.request_id] = d.finish_reason or finish.get(output.request_id)
    assert [tokens[f"c{i}"] for i in range(len(PROMPTS))] == expected
    assert [tokens[f"u{i}"] for i in range(len(PROMPTS))] == plain_alone
    for i in range(len(PROMPTS)):
        assert finish[f"c{i}"] == "stop"
        answer = decode_json(demo_model_dir, [t for t in tokens[f"c{i}"] if t not in engine.tokenizer.eos_token_ids])
        assert answer["kind"] in {"cat", "dog", "fish"} and len(answer["tags"]) <= 2


def test_preempted_constrained_sequences_resume_where_their_grammar_was(demo_model_dir, expected):
    tight = make_engine(demo_model_dir, num_kv_blocks=20)  # 80 token slots for 3 sequences of up to ~70
    got = run(tight, PROMPTS, constrained())
    assert tight.scheduler.num_preemptions > 0
    assert got == expected
    assert tight.block_manager.num_used_blocks == 0


def test_a_grammar_dead_end_fails_its_request_and_the_batch_goes_on(demo_model_dir):
    engine = make_engine(demo_model_dir)
    dead = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(grammar=DEAD_END))
    engine.add_request(Request("plain", PROMPTS[0], unconstrained()))
    engine.add_request(Request("dead", PROMPTS[1], dead))
    outputs = {}
    while engine.has_work():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    *first, failed = outputs["dead"]  # its one allowed token, then the dead end
    assert [t for o in first for d in o.deltas for t in d.token_ids] == [engine.tokenizer.encode("a")[0]]
    assert failed.finished and failed.deltas[0].finish_reason == "error"
    assert failed.client_error is not None and failed.client_error.status_code == 400
    plain = [t for o in outputs["plain"] for d in o.deltas for t in d.token_ids]
    assert plain == run(make_engine(demo_model_dir), [PROMPTS[0]], unconstrained())[0]


def test_a_compile_that_outlasts_the_timeout_is_a_400_naming_the_field(demo_model_dir):
    engine = make_async_engine(demo_model_dir, structured_output_compile_timeout=1e-6)
    body = {
        "model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}},
    }
    with TestClient(create_app(engine, engine.config), raise_server_exceptions=False) as client:
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "response_format" and "--structured-output-compile-timeout" in error["message"]
        assert client.post("/v1/chat/completions", json={**body, "response_format": None}).status_code == 200


def test_a_tokenizer_the_library_cannot_read_serves_without_structured_outputs(demo_model_dir, tmp_path):
    """A tokenizer.json without a decoder (llguidance cannot tell how its tokens spell text): the engine
    starts and serves; a constrained request is a 400 naming its field and saying why, in the API process
    and in the engine core alike."""
    model = tmp_path / "model"
    shutil.copytree(demo_model_dir, model)
    tokenizer_json = json.loads((model / "tokenizer.json").read_text())
    tokenizer_json["decoder"] = None
    (model / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    engine = make_async_engine(model)
    body = {"model": SERVED, "prompt": "hi", "max_tokens": 3, "structured_outputs": {"choice": ["yes", "no"]}}
    with TestClient(create_app(engine, engine.config), raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "structured_outputs" and "not available for this model" in error["message"]
        assert client.post("/v1/completions", json={**body, "structured_outputs": None}).status_code == 200
    core = make_engine(model)  # the engine core, handed a grammar the API process never checked
    with pytest.raises(InvalidRequestError, match="not available for this model"):
        core.grammars.new(json_grammar(SCHEMA))
