"""Make an app's OpenAPI document a true contract: request and response schemas from msgspec Structs,
every status code a route can return, all with the one error schema.

Litestar's own schema generator drops msgspec constraints inside unions (`str | list[str]` loses its
lengths) and documents its own 400 body, not ours; our controllers also decode bodies themselves to
name the bad field. So each route says what it takes and returns in its `opt` (`route_doc(...)`),
and `document_app` has the generated document rewritten once, when it is first asked for (not at app
creation: most apps never serve it): schemas straight from msgspec (exactly what the decoder enforces),
errors as `ErrorResponse`, streams as `text/event-stream`.

    @post("/v1/things", opt=route_doc(request=ThingRequest, response=Thing, errors=(400, 401, 404)))
    async def create_thing(request: Request) -> Response[Any]: ...

    app = Litestar(...); document_app(app)
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from litestar import Litestar, Request, Response
from litestar._openapi.plugin import OpenAPIPlugin
from litestar.handlers import HTTPRouteHandler
from litestar.routes import HTTPRoute

from shared.errors import InvalidRequestError
from shared.http_errors import error_body, readable

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
    304: "Not modified: the representation still has the ETag sent in If-None-Match (no body).",
    400: "Invalid request: a field is malformed or out of range (`param` names it), or the request "
    "cannot be served as asked (e.g. the prompt does not fit the context).",
    401: "Missing or invalid credentials: send `Authorization: Bearer <key>`.",
    403: "The credentials are valid but not allowed to do this.",
    404: "No such model, adapter or object.",
    408: "The request's body stopped arriving (no byte within the idle timeout); the connection is closed.",
    409: "Conflicts with the current state.",
    413: "The request body is over the size limit.",
    416: "The requested byte range lies outside the file (`Content-Range: bytes */SIZE` gives its size).",
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
    # other statuses that answer with the success body (e.g. 207/502 of a push: some/all engines failed)
    alternates: tuple[int, ...] = ()
    # document the operation at this path, not the route's: for a `{name:path}` route whose handler
    # matches a suffix itself (`…/{name}/activate`); path_params: each `{param}`'s JSON schema
    path: str | None = None
    path_params: dict[str, dict[str, Any]] | None = None
    operation_id: str | None = None  # with `path`: this operation's id (one handler, several paths)
    request_required: bool = True  # False: the body may be left out
    # a request body that is not JSON (e.g. an upload): its OpenAPI `content` map, as it is
    request_content: dict[str, Any] | None = None
    bodiless: tuple[int, ...] = ()  # other statuses answered with no body (e.g. 304 Not Modified)


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
    alternates: Iterable[int] = (),
    path: str | None = None,
    path_params: dict[str, Any] | None = None,
    operation_id: str | None = None,
    request_required: bool = True,
    request_content: dict[str, Any] | None = None,
    bodiless: Iterable[int] = (),
) -> dict[str, Any]:
    """The `opt` of a route handler that `document_app` reads. path_params: each `{param}` of `path`
    and its type (str when not named)."""
    errors = tuple(sorted(set(errors)))
    # schemas now: handlers are deep-copied, and msgspec.Meta cannot be
    params = {name: msgspec.json.schema(kind) for name, kind in (path_params or {}).items()}
    doc = RouteDoc(request, response, stream, errors, response_description, status, example, media_type,
                   tuple(alternates), path, params, operation_id, request_required, request_content,
                   tuple(bodiless))
    return {"route_doc": doc}


def route_docs(*opts: dict[str, Any]) -> dict[str, Any]:
    """The `opt` of one handler documented as several operations, each `route_doc(path=…)`: a handler
    that tells `…/{name}/heartbeat` from `…/{name}/drain` itself."""
    return {"route_doc": tuple(opt["route_doc"] for opt in opts)}


def _resolve(source: TypeSource | None, app: Litestar) -> type | None:
    if source is None or isinstance(source, type):
        return source
    return source(app)


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


ExtraErrors = Callable[[HTTPRouteHandler], Iterable[int]]
_PENDING = "loraplane.openapi.pending"  # in app.state until the document is rewritten: the extra_errors


class _RewrittenOnFirstUse(OpenAPIPlugin):
    """Litestar's OpenAPI plugin, whose document (built once and cached by the plugin, served by every
    renderer) is rewritten from the routes' RouteDocs before it is first handed out."""

    __slots__ = ()  # the same layout as OpenAPIPlugin's, so that an instance's class can become this one

    def provide_openapi_schema(self) -> dict[str, Any]:
        document = super().provide_openapi_schema()
        if _PENDING in self.app.state:
            extra_errors = self.app.state[_PENDING]
            del self.app.state[_PENDING]
            _rewrite_document(self.app, document, extra_errors)
        return document


def document_app(app: Litestar, extra_errors: ExtraErrors | None = None) -> None:
    """Have `app`'s OpenAPI document rewritten from its routes' RouteDocs when it is first asked for (call
    once, after all routes). extra_errors: statuses the app adds to some handlers (e.g. 401 where a guard
    needs a key)."""
    plugin = app.plugins.get(OpenAPIPlugin)
    plugin.__class__ = _RewrittenOnFirstUse
    app.state[_PENDING] = extra_errors


def _rewrite_document(app: Litestar, document: dict[str, Any], extra_errors: ExtraErrors | None) -> None:
    found: list[tuple[dict[str, Any], RouteDoc, dict[str, type | None]]] = []
    moved: list[tuple[dict[str, Any], str]] = []  # (path item, method) documented elsewhere (`path`)
    kept: list[tuple[int, str]] = []  # (id of path item, method) also documented where it is
    for route in app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        path_item = document.get("paths", {}).get(route.path_format, {})
        for handler in route.route_handlers:
            docs = handler.opt.get("route_doc")
            for doc in docs if isinstance(docs, tuple) else (docs,):
                if not isinstance(doc, RouteDoc):
                    continue
                if doc.path is not None:
                    methods = [m.lower() for m in handler.http_methods if m.lower() in path_item]
                    target = _relocate(document, path_item, methods, doc)
                    if target is path_item:  # one of the handler's documented paths is the route's own
                        kept += [(id(path_item), m) for m in methods]
                    else:
                        moved += [(path_item, m) for m in methods]
                    found += _found(app, target, handler, doc, extra_errors, methods)
                else:
                    found += _found(app, path_item, handler, doc, extra_errors)
    for path_item, method in moved:
        if (id(path_item), method) not in kept:
            path_item.pop(method, None)
    document["paths"] = {path: item for path, item in document.get("paths", {}).items()
                         if any(k in item for k in ("get", "post", "put", "patch", "delete"))}
    types = list(dict.fromkeys([ErrorResponse, *(t for _, _, r in found for t in r.values() if t is not None)]))
    refs, components = msgspec.json.schema_components(types, ref_template=_REF)
    ref_of = dict(zip(types, refs, strict=True))
    document.setdefault("components", {}).setdefault("schemas", {}).update(components)
    for operation, doc, resolved in found:
        _rewrite(operation, doc, resolved, ref_of)


def _found(app: Litestar, path_item: dict[str, Any], handler: HTTPRouteHandler, doc: RouteDoc,
           extra_errors: ExtraErrors | None,
           methods: Iterable[str] | None = None) -> list[tuple[dict[str, Any], RouteDoc, dict[str, type | None]]]:
    resolved = {k: _resolve(getattr(doc, k), app) for k in ("request", "response", "stream")}
    example = doc.example(app) if callable(doc.example) else doc.example
    errors = set(doc.errors) | set(extra_errors(handler) if extra_errors else ())
    doc = RouteDoc(**{**doc.__dict__, "errors": tuple(sorted(errors)), "example": example})
    methods = [m.lower() for m in handler.http_methods] if methods is None else methods
    return [(path_item[m], doc, resolved) for m in methods if m in path_item]


def _relocate(document: dict[str, Any], path_item: dict[str, Any], methods: list[str], doc: RouteDoc) -> dict[str, Any]:
    """Copy the generated operations to `doc.path`, their path parameters the ones `doc.path` names."""
    assert doc.path is not None
    target: dict[str, Any] = document.setdefault("paths", {}).setdefault(doc.path, {})
    names = re.findall(r"\{(\w+)\}", doc.path)
    for method in methods:
        operation = copy.deepcopy(path_item[method])
        params = [p for p in operation.get("parameters", []) if p.get("in") != "path"]
        schemas = doc.path_params or {}
        path = [{"name": n, "in": "path", "required": True, "schema": schemas.get(n, {"type": "string"})}
                for n in names]
        operation["parameters"] = path + params
        if doc.operation_id is not None:
            operation["operationId"] = doc.operation_id
        if doc.request is None and doc.request_content is None:
            operation.pop("requestBody", None)
        target[method] = operation
    return target


def _event_schema(chunk: dict[str, Any], ref_of: dict[type, dict[str, Any]]) -> dict[str, Any]:
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
    operation: dict[str, Any], doc: RouteDoc, resolved: dict[str, type | None], ref_of: dict[type, dict[str, Any]]
) -> None:
    request, response, stream, example = resolved["request"], resolved["response"], resolved["stream"], doc.example
    if doc.request_content is not None:
        operation["requestBody"] = {"required": doc.request_required, "content": doc.request_content}
    if request is not None:
        operation["requestBody"] = {"required": doc.request_required, "content": _json(ref_of[request])}
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
    for status in doc.alternates:
        responses[str(status)] = {**ok, "description": ERROR_DESCRIPTIONS.get(status, "Partial success.")}
    for status in doc.bodiless:
        responses[str(status)] = {"description": ERROR_DESCRIPTIONS.get(status, "No content.")}
    for status in doc.errors:
        responses[str(status)] = {
            "description": ERROR_DESCRIPTIONS.get(status, "Error."),
            "content": _json(ref_of[ErrorResponse]),
        }
    operation["responses"] = responses


_METHODS = ("get", "put", "post", "delete", "patch")


def options_response(request: Request[Any, Any, Any]) -> Response[None]:
    """An OPTIONS answer whose `Allow` lists the methods documented for the path asked: for one
    `{name:path}` route serving several documented paths (`…/{name}`, `…/{name}/activate`), where
    Litestar's own would list every method of the route."""
    allow = ", ".join(["OPTIONS", *documented_methods(request.app, request.url.path)])
    return Response(None, status_code=204, headers={"Allow": allow})


async def refuse_undocumented_method(request: Request[Any, Any, Any]) -> Response[Any] | None:
    """A controller's `before_request`: 405 with `Allow` for a method that no documented path matching
    the path asked lists (one `{name:path}` route serves several documented paths; where two of them
    match, as `…/x/versions/versions` does, the handler tells them apart)."""
    if request.method in ("OPTIONS", "HEAD"):
        return None
    if request.method in documented_methods(request.app, request.url.path, every_match=True):
        return None
    return method_not_allowed(request)


def method_not_allowed(request: Request[Any, Any, Any]) -> Response[Any]:
    """405 naming the methods the path's most literal documented template takes (also in `Allow`)."""
    allowed = documented_methods(request.app, request.url.path)
    return error_body(405, f"{request.method} is not allowed on {request.url.path[:200]}; this path takes "
                           f"{', '.join(allowed) or 'no method'}", headers={"Allow": ", ".join(["OPTIONS", *allowed])})


def documented_methods(app: Litestar, path: str, *, every_match: bool = False) -> list[str]:
    """The methods `app`'s document lists for `path` (its most literal matching path template): the
    `Allow` of an OPTIONS answer where one `{name:path}` route serves several documented paths.
    `every_match`: the methods of every template the path matches (`…/x/versions/versions` is both an
    upload for the name `x/versions` and a version named `versions` of `x`)."""
    document = app.plugins.get(OpenAPIPlugin).provide_openapi_schema()
    matches: list[tuple[int, dict[str, Any]]] = []
    for template, item in document.get("paths", {}).items():
        parts = re.split(r"(\{\w+\})", template)
        # a parameter is anything, newlines too (a name the handler refuses must reach the handler)
        pattern = "".join("[\\s\\S]+" if part.startswith("{") else re.escape(part) for part in parts)
        if re.fullmatch(pattern, path):
            matches.append((sum(len(part) for part in parts if not part.startswith("{")), item))
    if not every_match:
        matches = [max(matches, key=lambda m: m[0])] if matches else []
    return [m.upper() for m in _METHODS if any(m in item for _, item in matches)]


T = TypeVar("T")
_AT = re.compile(r"`\$\.?([^`]*)`")  # "… - at `$.labels`", "… - at `key` in `$.labels`"
_MISSING = re.compile(r"missing required field `([^`]+)`")


def field_of(message: str) -> str | None:
    """The field a msgspec error is about, as the OpenAI `param`: 'Expected `int`, got `str` - at
    `$.messages[0].role`' → 'messages[0].role'; 'Object missing required field `model`' → 'model'."""
    where = _AT.findall(message)
    missing = _MISSING.search(message)
    parts = [p for p in (where[-1] if where else "", missing.group(1) if missing else "") if p]
    return ".".join(parts) or None


def decode_body(body: bytes, kind: type[T]) -> T:
    """`body` decoded strictly as the document says: Litestar's own body decoding coerces (`0` passes
    as a bool, `"1"` as an int), so a schema-violating request would be accepted. JSON Schema counts
    2.0 as an integer, so integral floats are retried as integers. Errors are 400s naming the field.
    Both apps decode every JSON body through this (the engine's generation routes via
    data_plane.api.protocol.decode_request)."""
    if not body.strip():
        raise InvalidRequestError("The request body is empty; expected a JSON object.")
    try:
        try:
            return msgspec.json.decode(body, type=kind)
        except msgspec.ValidationError as exc:
            if "got `float`" not in str(exc):
                raise
            return msgspec.convert(_as_ints(msgspec.json.decode(body)), type=kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"Invalid request: {readable(str(exc))}", param=field_of(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"Malformed JSON body: {exc}") from None
    except RecursionError:  # even in an ignored field: arrays nested thousands deep
        raise InvalidRequestError("The JSON body is nested too deeply.") from None


def _as_ints(value: Any) -> Any:
    """Integral floats as ints, throughout (iteratively: the value may be nested deeply)."""
    root = [value]
    stack: list[Any] = [root]
    while stack:
        container = stack.pop()
        for key, item in list(container.items() if isinstance(container, dict) else enumerate(container)):
            if isinstance(item, float) and item.is_integer():
                container[key] = int(item)
            elif isinstance(item, dict | list):
                stack.append(item)
    return root[0]
