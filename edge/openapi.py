"""The edge's OpenAPI 3.1 document (``GET /openapi.json``), generated from the routes: each view
declares its operation with :func:`documented` (the pydantic models it takes and answers with), the
app's URL rules give the paths and methods, and the models' schemas are the components.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from quart import Quart

from edge.deadlines import IDLE_TIMEOUT_HEADER, TIMEOUT_HEADER
from edge.requests.errors import ErrorResponse

REF = "#/components/schemas/{model}"
# Who may call: the API key as a bearer token, or also in Anthropic's header.
BEARER = ("bearerAuth",)
BEARER_OR_KEY = ("bearerAuth", "apiKeyHeader")

_ERRORS = {
    "400": "Invalid request: bad JSON, wrong Content-Type, or a field missing or out of range "
    "(`param` names it). Also what the worker refuses (for example `tools`).",
    "401": "API keys are configured and the request has no valid `Authorization: Bearer <key>` "
    "(or `x-api-key: <key>`).",
    "404": "Unknown model (`code: model_not_found`) or route.",
    "413": "The body is larger than the edge's `--max-body-bytes`.",
    "422": "The body is valid JSON but not a JSON object.",
    "429": "Every worker's queue is full, the caller is at its concurrency limit, or its API key spent its "
    "requests or tokens per minute (`code: rate_limit_exceeded`, with the `x-ratelimit-*` headers); retry "
    "after `Retry-After` seconds.",
    "500": "An internal error (no detail is shown).",
    "503": "No worker is available; retry after `Retry-After` seconds.",
    "504": "The request's deadline passed before it started.",
}
_RETRY_STATUSES = {"429", "503"}
_GENERATION_STATUSES = ("400", "401", "404", "413", "422", "429", "500", "503", "504")
_UNARY_STATUSES = ("400", "401", "404", "413", "422", "500", "503")
# Seconds as edge.deadlines parses them: a plain decimal number (no sign, exponent, inf or nan);
# it must also be positive, which the descriptions say.
_SECONDS_PATTERN = "^[0-9]{1,9}(\\.[0-9]{1,9})?$"
_REQUEST_HEADERS: list[dict[str, Any]] = [
    {
        "name": name,
        "in": "header",
        "required": False,
        "description": description,
        "schema": {"type": "string", "pattern": _SECONDS_PATTERN},
    }
    for name, description in (
        (
            TIMEOUT_HEADER,
            "The request's total deadline in seconds (default `--request-timeout`, values above "
            "`--max-request-timeout` are clamped). Anything but a positive decimal number (zero included) "
            "is a 400 naming the header.",
        ),
        (
            IDLE_TIMEOUT_HEADER,
            "The longest silence of the worker in seconds (default `--idle-timeout`, clamped to "
            "`--max-idle-timeout`). Anything but a positive decimal number (zero included) is a 400 "
            "naming the header.",
        ),
    )
] + [
    {
        "name": "X-Request-ID",
        "in": "header",
        "required": False,
        "description": "Echoed in the response and carried to the worker's logs when it is 1-128 "
        "header-safe characters; otherwise the edge makes a new id.",
        "schema": {"type": "string"},
    }
]
_SSE_SCHEMA = {"type": "string", "description": "Server-Sent Events; see the response description."}


class Operation(Protocol):
    """What one route declares: its OpenAPI operation object and the models that object names."""

    def operation(self) -> dict[str, Any]: ...

    def models(self) -> tuple[type[BaseModel], ...]: ...


def schema_ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _security(schemes: tuple[str, ...]) -> list[dict[str, list[str]]]:
    return [{scheme: []} for scheme in schemes]


def _headers(*names: str) -> dict[str, Any]:
    return {name: {"$ref": f"#/components/headers/{name}"} for name in names}


def _error_responses(*statuses: str, model: type[BaseModel] = ErrorResponse) -> dict[str, Any]:
    responses = {}
    for status in statuses:
        headers = _headers("X-Request-ID", "X-Sluice-Worker-ID")
        if status in _RETRY_STATUSES:
            headers.update(_headers("Retry-After"))
        responses[status] = {
            "description": _ERRORS[status],
            "headers": headers,
            "content": {"application/json": {"schema": schema_ref(model)}},
        }
    return responses


def _json(model: type[BaseModel], description: str, *headers: str) -> dict[str, Any]:
    return {
        "description": description,
        "headers": _headers("X-Request-ID", *headers),
        "content": {"application/json": {"schema": schema_ref(model)}},
    }


def _streamed(answer: type[BaseModel], stream: str, event: type[BaseModel]) -> dict[str, Any]:
    """The 200 of a route that answers one JSON ``answer`` or, with ``stream: true``, a stream of
    ``event`` data described by ``stream``."""
    ok = _json(
        answer,
        f"With `stream: false` (the default): one `{answer.__name__}` (`application/json`). "
        f"With `stream: true`: `text/event-stream`, {stream}",
        "X-Sluice-Worker-ID",
    )
    ok["headers"].update(_headers("Cache-Control"))
    ok["content"]["text/event-stream"] = {"schema": _SSE_SCHEMA, "x-sse-data-schema": schema_ref(event)}
    return ok


def _post(
    summary: str,
    request: type[BaseModel],
    responses: dict[str, Any],
    security: tuple[str, ...],
    parameters: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A POST operation taking a JSON ``request`` body."""
    operation: dict[str, Any] = {"summary": summary, "security": _security(security)}
    if parameters is not None:
        operation["parameters"] = parameters
    operation["requestBody"] = {
        "required": True,
        "content": {"application/json": {"schema": schema_ref(request)}},
    }
    operation["responses"] = responses
    return operation


@dataclass(frozen=True)
class Generation:
    """A generation route of an OpenAI surface: one JSON ``answer``, or ``chunk``s as ``data:``
    events ending with ``[DONE]``; the deadline headers; every error a generation can meet."""

    summary: str
    request: type[BaseModel]
    answer: type[BaseModel]
    chunk: type[BaseModel]

    def operation(self) -> dict[str, Any]:
        stream = (
            f"one `data: <chunk JSON>` event per chunk (`{self.chunk.__name__}`), ending with "
            "`data: [DONE]`; a failure after the stream began is an `event: error` whose data is an "
            "`ErrorResponse`, then `data: [DONE]`; `: heartbeat` comments keep an idle stream open."
        )
        ok = _streamed(self.answer, stream, self.chunk)
        responses = {"200": ok, **_error_responses(*_GENERATION_STATUSES)}
        return _post(self.summary, self.request, responses, BEARER, _REQUEST_HEADERS)

    def models(self) -> tuple[type[BaseModel], ...]:
        return (self.request, self.answer, self.chunk, ErrorResponse)


@dataclass(frozen=True)
class NamedEventGeneration:
    """A generation route of a surface with its own named events (Responses, Anthropic, native):
    ``stream`` says how its stream runs; ``error`` is its error body."""

    summary: str
    request: type[BaseModel]
    answer: type[BaseModel]
    event: type[BaseModel]
    stream: str
    error: type[BaseModel] = ErrorResponse
    security: tuple[str, ...] = BEARER

    def operation(self) -> dict[str, Any]:
        ok = _streamed(self.answer, self.stream, self.event)
        responses = {"200": ok, **_error_responses(*_GENERATION_STATUSES, model=self.error)}
        return _post(self.summary, self.request, responses, self.security)

    def models(self) -> tuple[type[BaseModel], ...]:
        return (self.request, self.answer, self.event, self.error)


@dataclass(frozen=True)
class Unary:
    """A route answered by one unary worker call (no stream): the tokenizer routes, and with
    ``pooled`` the routes the pooling workers serve (embeddings, rerank, score: the timeout headers,
    429 and 504 too); ``path_parameters``: each parameter's description (the stored objects'
    updates)."""

    summary: str
    request: type[BaseModel]
    answer: type[BaseModel]
    error: type[BaseModel] = ErrorResponse
    security: tuple[str, ...] = BEARER
    pooled: bool = False
    path_parameters: Mapping[str, str] = field(default_factory=dict)

    def operation(self) -> dict[str, Any]:
        statuses = _UNARY_STATUSES + (("429", "504") if self.pooled else ())
        ok = _json(self.answer, f"One `{self.answer.__name__}`.", "X-Sluice-Worker-ID")
        responses = {"200": ok, **_error_responses(*statuses, model=self.error)}
        parameters = [*_path(self.path_parameters), *(_REQUEST_HEADERS if self.pooled else [])]
        return _post(self.summary, self.request, responses, self.security, parameters or None)

    def models(self) -> tuple[type[BaseModel], ...]:
        return (self.request, self.answer, self.error)


@dataclass(frozen=True)
class LlamaCppGeneration:
    """``/infill``: llama.cpp's body and answer, streamed as llama.cpp streams (no ``[DONE]``)."""

    summary: str
    request: type[BaseModel]
    answer: type[BaseModel]

    def operation(self) -> dict[str, Any]:
        operation = Unary(self.summary, self.request, self.answer).operation()
        ok = operation["responses"]["200"]
        ok["description"] = (
            f"With `stream: false` (the default): one `{self.answer.__name__}`. With `stream: true`: "
            '`text/event-stream`, one `data: {"content": ..., "stop": false}` event per delta, then '
            f"`data: <{self.answer.__name__}>` (`stop: true`, empty `content`); no `[DONE]`."
        )
        ok["content"]["text/event-stream"] = {
            "schema": _SSE_SCHEMA,
            "x-sse-data-schema": schema_ref(self.answer),
        }
        operation["responses"].update(_error_responses("429", "504"))
        return operation

    def models(self) -> tuple[type[BaseModel], ...]:
        return (self.request, self.answer, ErrorResponse)


@dataclass(frozen=True)
class Read:
    """A request without a body answered with one JSON ``answer`` (the model lists; a stored
    response read, deleted or cancelled); ``path_parameters`` and ``query_parameters``: each
    parameter's description."""

    summary: str
    answer: type[BaseModel]
    description: str
    statuses: tuple[str, ...] = ("401", "503")
    error: type[BaseModel] = ErrorResponse
    security: tuple[str, ...] = BEARER
    path_parameters: Mapping[str, str] = field(default_factory=dict)
    query_parameters: Mapping[str, str] = field(default_factory=dict)

    def operation(self) -> dict[str, Any]:
        operation: dict[str, Any] = {"summary": self.summary, "security": _security(self.security)}
        parameters = _path(self.path_parameters) + [
            {
                "name": name,
                "in": "query",
                "required": False,
                "description": text,
                "schema": {"type": "string"},
            }
            for name, text in self.query_parameters.items()
        ]
        if parameters:
            operation["parameters"] = parameters
        operation["responses"] = {
            "200": _json(self.answer, self.description, "X-Sluice-Worker-ID"),
            **_error_responses(*self.statuses, model=self.error),
        }
        return operation

    def models(self) -> tuple[type[BaseModel], ...]:
        return (self.answer, self.error)


def _path(parameters: Mapping[str, str]) -> list[dict[str, Any]]:
    """Path parameters (strings), each with its description."""
    return [
        {"name": name, "in": "path", "required": True, "description": text, "schema": {"type": "string"}}
        for name, text in parameters.items()
    ]


@dataclass(frozen=True)
class Probe:
    """An open GET answered with JSON (health, readiness): ``answers`` maps each status to its
    model and description."""

    summary: str
    answers: Mapping[str, tuple[type[BaseModel], str]]

    def operation(self) -> dict[str, Any]:
        responses = {status: _json(model, text) for status, (model, text) in self.answers.items()}
        return {"summary": self.summary, "responses": responses}

    def models(self) -> tuple[type[BaseModel], ...]:
        return tuple(model for model, _ in self.answers.values())


@dataclass(frozen=True)
class Page:
    """An open GET whose 200 is a body of ``media_type`` with no model (metrics, a page, this
    document)."""

    summary: str
    media_type: str
    description: str
    kind: str = "string"

    def operation(self) -> dict[str, Any]:
        content = {self.media_type: {"schema": {"type": self.kind}}}
        return {
            "summary": self.summary,
            "responses": {"200": {"description": self.description, "content": content}},
        }

    def models(self) -> tuple[type[BaseModel], ...]:
        return ()


View = TypeVar("View", bound=Callable[..., Any])
# View function -> its operation by path (None: every path the view serves).
_DECLARED: dict[Callable[..., Any], dict[str | None, Operation]] = {}


def documented(operation: Operation, *, path: str | None = None) -> Callable[[View], View]:
    """Declares a view's operation, for every path it serves or only for ``path`` (as written in
    its route); put it under the route decorators."""

    def declare(view: View) -> View:
        _DECLARED.setdefault(view, {})[path] = operation
        return view

    return declare


def operations(app: Quart) -> Iterator[tuple[str, str, Operation]]:
    """``(OpenAPI path, method, operation)`` of every route of ``app`` in the order it was added
    (its static files left out); raises ``LookupError`` naming a route that declares none."""
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        declared = _DECLARED.get(app.view_functions[rule.endpoint], {})
        operation = declared.get(rule.rule) or declared.get(None)
        if operation is None:
            raise LookupError(
                f"the route {rule.rule} ({rule.endpoint}) declares no operation: add @documented"
            )
        path = re.sub(r"<(?:[a-z]+:)?([a-z_]+)>", r"{\1}", rule.rule)
        for method in sorted(set(rule.methods or ()) - {"HEAD", "OPTIONS"}):
            yield path, method.lower(), operation


def component_schemas(models: list[type[BaseModel]]) -> dict[str, Any]:
    """``components/schemas``: ``models`` and the models they use."""
    _, top = models_json_schema([(model, "validation") for model in models], ref_template=REF)
    schemas: dict[str, Any] = top["$defs"]
    return schemas


def openapi_document(app: Quart) -> dict[str, Any]:
    """The whole document of ``app``'s routes (built once per app; treat it as read-only)."""
    document: dict[str, Any] | None = app.extensions.get("sluice.openapi")
    if document is None:
        document = app.extensions["sluice.openapi"] = _document(app)
    return document


def _document(app: Quart) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    models: dict[type[BaseModel], None] = {}
    for path, method, operation in operations(app):
        paths.setdefault(path, {})[method] = operation.operation()
        models.update(dict.fromkeys(operation.models()))
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Sluice edge",
            "version": "1",
            "description": "OpenAI-compatible HTTP API in front of Sluice gRPC workers. "
            "See docs/http.md for where it differs from OpenAI.",
        },
        "paths": paths,
        "components": {
            "schemas": component_schemas(list(models)),
            "headers": {
                "X-Request-ID": {
                    "description": "The caller's X-Request-ID (1-128 header-safe characters), else a new id.",
                    "schema": {"type": "string"},
                },
                "X-Sluice-Worker-ID": {
                    "description": "The id(s) of the worker(s) that served the request, comma-separated; "
                    "absent when no worker was reached (validation errors, 401, 413, 503).",
                    "schema": {"type": "string"},
                },
                "Retry-After": {
                    "description": "Seconds to wait before retrying.",
                    "schema": {"type": "integer"},
                },
                "Cache-Control": {
                    "description": "`no-cache` on streams.",
                    "schema": {"type": "string"},
                },
            },
            "securitySchemes": {
                "bearerAuth": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "Checked only when the edge runs with --api-keys / --api-keys-file.",
                },
                "apiKeyHeader": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "x-api-key",
                    "description": "The same keys as bearerAuth, in Anthropic's header.",
                },
            },
        },
    }
