"""The router's OpenAPI document says what the router (and the engines behind it) in fact require: a
completion's `prompt` and a chat's `messages` are required, and a request without them is a 400 naming the
field."""

from __future__ import annotations

import httpx

from tests.data_plane.router.support import RoutesServer, serve_router, serve_routes


def test_prompt_and_messages_are_required_in_the_document() -> None:
    with serve_routes(RoutesServer()) as routes, serve_router(routes.url) as router:
        doc = httpx.get(router.url + "/schema/openapi.json", timeout=30).json()
        # and so it is: a 400 naming the field, before any routing (no engine holds `demo` here)
        for path, field in (("/completions", "prompt"), ("/chat/completions", "messages")):
            r = httpx.post(router.api + path, json={"model": "demo", "max_tokens": 1}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    schemas = doc["components"]["schemas"]

    def body(path: str) -> dict:
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        return schemas[ref.rsplit("/", 1)[1]]

    completion, chat = body("/v1/completions"), body("/v1/chat/completions")
    assert set(completion["required"]) == {"model", "prompt"}, completion
    assert set(chat["required"]) == {"model", "messages"}, chat
    assert chat["properties"]["messages"]["minItems"] == 1
    # an empty `model` is the router's own 400, so the document says so
    assert completion["properties"]["model"]["minLength"] == chat["properties"]["model"]["minLength"] == 1
