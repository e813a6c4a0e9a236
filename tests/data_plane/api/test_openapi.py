"""The engine's OpenAPI document is a contract: typed requests and responses, the engine's own limits,
every status a route answers; bodies match their schemas; a wrong method is a 405 with `Allow`;
--api-key guards the inference endpoints only."""

from __future__ import annotations

import json
import re

import msgspec
import pytest
from litestar.testing import TestClient

from data_plane.api import schemas
from data_plane.api.app import create_app
from shared.openapi import ErrorResponse
from tests.data_plane.api.engines import MAX_MODEL_LEN, SERVED, make_engine
from tests.data_plane.api.test_app import CHAT, COMPLETIONS, chat_body, sse_events


@pytest.fixture
def client_for(demo_model_dir):
    """An app over a real engine on the demo checkpoint, with these EngineConfig fields."""

    def make(**config) -> TestClient:
        engine = make_engine(demo_model_dir, **config)
        return TestClient(create_app(engine, engine.config), raise_server_exceptions=False)

    return make


def test_requests_and_responses_are_typed_with_the_engines_limits(client_for, demo_model_dir):
    vocab_size = json.loads((demo_model_dir / "config.json").read_text())["vocab_size"]
    with client_for(max_n=3, max_stop_strings=5, max_stop_string_length=7) as client:
        doc = client.get("/schema/openapi.json").json()
    components = doc["components"]["schemas"]
    chat = doc["paths"][CHAT]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")
    assert chat["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletion")
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    assert set(chat["responses"]) == {"200", "400", "404", "413", "500", "503"}  # no key: no 401
    for status in ("400", "404", "503"):
        assert chat["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    props = components["CompletionRequest"]["properties"]
    assert props["n"]["anyOf"][0]["maximum"] == 3
    stop_string, stop_list = props["stop"]["anyOf"][0], props["stop"]["anyOf"][1]
    assert stop_string["maxLength"] == 7 and stop_list["maxItems"] == 5
    assert props["max_tokens"]["anyOf"][0]["maximum"] == MAX_MODEL_LEN
    assert props["seed"]["anyOf"][0]["maximum"] == 2**63 - 1
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        bias = components[request]["properties"]["logit_bias"]["anyOf"][0]
        assert bias["maxProperties"] == 300
        assert bias["additionalProperties"] == {"type": "number", "minimum": -100, "maximum": 100}
        ids = re.compile(bias["propertyNames"]["pattern"])
        assert ids.fullmatch("0") and ids.fullmatch(str(vocab_size - 1)) and not ids.fullmatch(str(vocab_size))
        assert not ids.fullmatch("-1") and not ids.fullmatch("01") and not ids.fullmatch("1.5")
        # structured outputs: OpenAI's response_format and vLLM's structured_outputs
        fields = components[request]["properties"]
        assert fields["response_format"]["anyOf"][0]["$ref"].endswith("/ResponseFormat")
        assert fields["structured_outputs"]["anyOf"][0]["$ref"].endswith("/StructuredOutputs")
    assert set(components["ResponseFormat"]["properties"]["type"]["enum"]) == {"text", "json_object", "json_schema"}
    assert {"name", "schema", "strict"} <= set(components["JsonSchemaFormat"]["properties"])
    assert set(components["StructuredOutputs"]["properties"]) == {"json", "json_object", "regex", "choice", "grammar"}
    roles = components["ChatMessage"]["properties"]["role"]["enum"]
    assert "user" in roles and "wizard" not in roles
    assert doc["paths"]["/health"]["get"]["responses"]["503"]
    assert doc["paths"]["/v1/models/{model_id}"]["get"]["responses"]["404"]
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]


def test_bodies_match_their_schemas(client_for):
    with client_for() as client:
        strict = msgspec.json.decode
        strict(client.post(CHAT, json=chat_body(n=2, logprobs=True, top_logprobs=2, return_token_ids=True)).content,
               type=schemas.ChatCompletion)
        body = {"model": SERVED, "prompt": ["ab", "cd"], "max_tokens": 3, "logprobs": 1, "return_token_ids": True}
        strict(client.post(COMPLETIONS, json=body).content, type=schemas.Completion)
        for path, chunk in ((CHAT, schemas.ChatCompletionChunk), (COMPLETIONS, schemas.CompletionChunk)):
            req = chat_body(stream=True, stream_options={"include_usage": True}, return_token_ids=True, echo=True)
            if path == COMPLETIONS:
                req = {**req, "prompt": "hi"}
            events = sse_events(client.post(path, json=req).text)
            assert events[-1] == "[DONE]"
            for event in events[:-1]:
                msgspec.convert(event, type=chunk)
        strict(client.get("/v1/models").content, type=schemas.ModelList)
        strict(client.get(f"/v1/models/{SERVED}").content, type=schemas.ModelCard)
        strict(client.get("/health").content, type=schemas.Health)
        strict(client.get("/version").content, type=schemas.Version)
        strict(client.get("/v1/models/nope").content, type=ErrorResponse)


def test_a_wrong_method_is_405_with_allow(client_for):
    with client_for() as client:
        r = client.delete(COMPLETIONS)
    assert r.status_code == 405
    assert "POST" in r.headers["allow"]
    assert r.json()["error"]["code"] == 405


def test_the_api_key_guards_inference_only(client_for):
    with client_for(api_key="sk-test-key") as client:
        doc = client.get("/schema/openapi.json").json()
        for path, method in ((CHAT, "post"), (COMPLETIONS, "post"), ("/v1/models", "get")):
            assert "401" in doc["paths"][path][method]["responses"]
        assert "401" not in doc["paths"]["/health"]["get"]["responses"]
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-test-key"}):
            for r in (client.post(CHAT, json=chat_body(), headers=headers), client.get("/v1/models", headers=headers)):
                assert r.status_code == 401, r.text
                error = r.json()["error"]
                assert error["code"] == "invalid_api_key" and "sk-test-key" not in json.dumps(error)
        ok = {"Authorization": "Bearer sk-test-key"}
        assert client.post(CHAT, json=chat_body(), headers=ok).status_code == 200
        assert client.get(f"/v1/models/{SERVED}", headers=ok).status_code == 200
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


@pytest.fixture
def keyed_engine(start_engine, monkeypatch):
    monkeypatch.setenv("LORAPLANE_API_KEY", "sk-engine-key")  # through the environment, not `ps`
    return start_engine()


def test_a_real_engine_takes_its_key_from_the_environment(keyed_engine):
    import httpx

    assert httpx.get(keyed_engine.api + "/models", timeout=30).status_code == 401
    r = httpx.get(keyed_engine.api + "/models", headers={"Authorization": "Bearer sk-engine-key"}, timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "demo"
    assert httpx.get(keyed_engine.url + "/health", timeout=30).status_code == 200
    assert "sk-engine-key" not in keyed_engine.log.read_text()
