"""Structured outputs on a tensor-parallel engine (two CPU ranks): rank 0 masks and samples, and its
constrained greedy tokens are the oracle's (transformers' logits masked by llguidance); a required tool
choice gives a call valid against its tool's schema."""

from __future__ import annotations

import json

import httpx
import jsonschema

from tests.data_plane.api.conftest import SERVED_NAME, run_engine
from tests.data_plane.structured.oracle import MAX_TOKENS, PROMPTS, SCHEMA, constrained_greedy, json_grammar


def test_tp2_constrained_greedy_matches_the_oracle(demo_model_dir, tmp_path):
    expected = constrained_greedy(demo_model_dir, PROMPTS[0], json_grammar(SCHEMA), MAX_TOKENS)
    flags = ("--tensor-parallel-size", "2", "--num-kv-blocks", "64", "--max-model-len", "1024")
    with run_engine(demo_model_dir, tmp_path / "tp.log", *flags) as server:
        body = {"model": SERVED_NAME, "prompt": PROMPTS[0], "temperature": 0.0, "max_tokens": MAX_TOKENS,
                "return_token_ids": True, "structured_outputs": {"json": SCHEMA}}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == expected and choice["finish_reason"] == "stop"
        tool = {"type": "function", "function": {"name": "describe", "parameters": SCHEMA}}
        chat = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "A pet?"}], "temperature": 0.0,
                "max_tokens": 2 * MAX_TOKENS, "tools": [tool], "tool_choice": "required"}
        r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200, r.text
        [choice] = r.json()["choices"]
        [call] = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "describe"
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
