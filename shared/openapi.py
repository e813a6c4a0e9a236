"""Make an app's OpenAPI document a true contract: request and response schemas from msgspec Structs,
every status code a route can return, all with the one error schema.

Litestar's own schema generator drops msgspec constraints inside unions (`str | list[str]` loses its
lengths) and documents its own 400 body, not ours; our controllers also decode bodies themselves to
name the bad field. So each route says what it takes and returns in its `opt` (`route_doc(...)`),
and `document_app` rewrites the generated document once: schemas straight from msgspec (exactly
what the decoder enforces), errors as `ErrorResponse`, streams as `text/event-stream`.

    @post("/v1/things", opt=route_doc(request=ThingRequest, response=Thing, errors=(400, 401, 404)))
    async def create_thing(request: Request) -> Response[Any]: ...

    app = Litestar(...); document_app(app)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Litestar
from litestar._openapi.plugin import OpenAPIPlugin
from litestar.handlers import HTTPRouteHandler
from litestar.routes import HTTPRoute

_REF = "#/components/schemas/{name}"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(msgspec.Struct):
    """Every error of every route: OpenAI's shape, `param` naming the offending field when one is."""

    error: ErrorDetail


ERROR_DESCRIPTIONS = {
    400: "Invalid request: a field is malformed or out of range (`param` names it), or the request "
    "cannot be served as asked (e.g. the prompt does not fit the context).",
    401: "Missing or invalid credentials: send `Authorization: Bearer <key>`.",
    403: "The credentials are valid but not allowed to do this.",
    404: "No such model, adapter or object.",
    409: "Conflicts with the current state.",
    413: "The request body is over the size limit.",
    500: "The server failed to process the request (details are in its log, never in the body).",
    502: "An upstream engine failed or answered badly.",
    503: "Not available now: overloaded, draining, or the engine is not running. Retry later.",
}

# A type, or a callable that returns one for the app (limits that depend on the app's configuration).
TypeSource = type | Callable[[Litestar], type]


@dataclass(frozen=True)
class RouteDoc:
    request: TypeSource | None = None
    response: TypeSource | None = None
    stream: TypeSource | None = None  # each `data:` event of a text/event-stream 200 (when `stream`)
    errors: tuple[int, ...] = ()
    response_description: str = "Success."
    status: int = 200  # the success status
    # an example request body (or a callable making one for the app): what a working call looks like
    example: Any = None
    media_type: str | None = None  # a success body that is not JSON (e.g. Prometheus text): its type


def route_doc(
    *,
    request: TypeSource | None = None,
    response: TypeSource | None = None,
    stream: TypeSource | None = None,
    errors: Iterable[int] = (),
    response_description: str = "Success.",
    status: int = 200,
    example: Any = None,
    media_type: str | None = None,
) -> dict[str, Any]:
    """The `opt` of a route handler that `document_app` reads."""
    errors = tuple(sorted(set(errors)))
    doc = RouteDoc(request, response, stream, errors, response_description, status, example, media_type)
    return {"route_doc": doc}


def _resolve(source: TypeSource | None, app: Litestar) -> type | None:
    if source is None or isinstance(source, type):
        return source
    return source(app)


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def document_app(app: Litestar, extra_errors: Callable[[HTTPRouteHandler], Iterable[int]] | None = None) -> None:
    """Rewrite `app`'s OpenAPI document from its routes' RouteDocs (call once, after all routes).
    extra_errors: statuses the app adds to some handlers (e.g. 401 where a guard needs a key)."""
    document = app.plugins.get(OpenAPIPlugin).provide_openapi_schema()  # cached: every renderer serves it
    found: list[tuple[dict[str, Any], RouteDoc, dict[str, type | None]]] = []
    for route in app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        path_item = document.get("paths", {}).get(route.path_format, {})
        for handler in route.route_handlers:
            doc = handler.opt.get("route_doc")
            if not isinstance(doc, RouteDoc):
                continue
            resolved = {k: _resolve(getattr(doc, k), app) for k in ("request", "response", "stream")}
            example = doc.example(app) if callable(doc.example) else doc.example
            errors = set(doc.errors) | set(extra_errors(handler) if extra_errors else ())
            doc = RouteDoc(**{**doc.__dict__, "errors": tuple(sorted(errors)), "example": example})
            found += [(path_item[m.lower()], doc, resolved) for m in handler.http_methods if m.lower() in path_item]
    types = list(dict.fromkeys([ErrorResponse, *(t for _, _, r in found for t in r.values() if t is not None)]))
    refs, components = msgspec.json.schema_components(types, ref_template=_REF)
    ref_of = dict(zip(types, refs, strict=True))
    document.setdefault("components", {}).setdefault("schemas", {}).update(components)
    for operation, doc, resolved in found:
        _rewrite(operation, doc, resolved, ref_of)


def _event_schema(chunk: dict[str, Any], ref_of: dict[type, dict]) -> dict[str, Any]:
    """One server-sent event (before OpenAPI 3.2's itemSchema, a text/event-stream `schema` describes
    each event): its `data` is a chunk's JSON, an error's JSON, or the final literal `[DONE]`."""
    name = chunk["$ref"].rsplit("/", 1)[-1]
    return {
        "type": "object",
        "description": f"With `stream: true`: one `data: <{name} JSON>` event per chunk, then `data: [DONE]`; "
        "an error after the response has started is one `data: <ErrorResponse JSON>` event before [DONE].",
        "required": ["data"],
        "properties": {
            "event": {"type": "string"},
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {"anyOf": [chunk, ref_of[ErrorResponse]]},
                    },
                ]
            },
        },
    }


def _rewrite(
    operation: dict[str, Any], doc: RouteDoc, resolved: dict[str, type | None], ref_of: dict[type, dict]
) -> None:
    request, response, stream, example = resolved["request"], resolved["response"], resolved["stream"], doc.example
    if request is not None:
        operation["requestBody"] = {"required": True, "content": _json(ref_of[request])}
        if example is not None:
            operation["requestBody"]["content"]["application/json"]["example"] = example
    ok: dict[str, Any] = {"description": doc.response_description}
    if response is not None:
        ok["content"] = _json(ref_of[response])
    if doc.media_type is not None:
        ok.setdefault("content", {})[doc.media_type] = {"schema": {"type": "string"}}
    if stream is not None:
        ok.setdefault("content", {})["text/event-stream"] = {"schema": _event_schema(ref_of[stream], ref_of)}
    responses = {str(doc.status): ok}
    for status in doc.errors:
        responses[str(status)] = {
            "description": ERROR_DESCRIPTIONS.get(status, "Error."),
            "content": _json(ref_of[ErrorResponse]),
        }
    operation["responses"] = responses
