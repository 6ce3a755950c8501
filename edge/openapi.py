"""The edge's OpenAPI 3.1 document (``GET /openapi.json``): component schemas generated from the
pydantic request and response models of every surface, paths listed here by hand (a test checks
that every served route is documented and that the document validates).
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from edge.deadlines import IDLE_TIMEOUT_HEADER, TIMEOUT_HEADER
from edge.requests.errors import ErrorResponse
from edge.routes.bodies import Health, ModelList, ModelObject, Readiness
from edge.surfaces.anthropic.request import CountTokensRequest, MessagesRequest
from edge.surfaces.anthropic.response import (
    AnthropicErrorResponse,
    AnthropicMessage,
    AnthropicStreamEvent,
    InputTokens,
)
from edge.surfaces.chat.response import ChatCompletion, ChatCompletionChunk
from edge.surfaces.completions.infill import InfillRequest, InfillResult
from edge.surfaces.completions.request import CompletionRequest
from edge.surfaces.completions.response import TextCompletion, TextCompletionChunk
from edge.surfaces.embeddings.request import EmbeddingRequest
from edge.surfaces.embeddings.response import EmbeddingList
from edge.surfaces.native.request import NativeChatRequest
from edge.surfaces.native.response import (
    NativeChatResult,
    NativeErrorResponse,
    NativeModelList,
    NativeStreamEvent,
)
from edge.surfaces.responses.request import ResponsesRequest
from edge.surfaces.responses.response import ResponseObject, ResponseStreamEvent
from edge.surfaces.scores.request import RerankRequest, ScoreRequest
from edge.surfaces.scores.response import RerankResponse, ScoreList
from edge.surfaces.shared.chat_request import ChatCompletionRequest
from edge.surfaces.tokenize.request import DetokenizeRequest, TokenizeRequest
from edge.surfaces.tokenize.response import DetokenizeResult, TokenizeResult

REF = "#/components/schemas/{model}"
REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
    MessagesRequest,
    NativeChatRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    CountTokensRequest,
    TokenizeRequest,
    DetokenizeRequest,
    InfillRequest,
)
RESPONSE_MODELS: tuple[type[BaseModel], ...] = (
    ErrorResponse,
    ChatCompletion,
    ChatCompletionChunk,
    TextCompletion,
    TextCompletionChunk,
    ModelObject,
    ModelList,
    Health,
    Readiness,
    ResponseObject,
    ResponseStreamEvent,
    AnthropicMessage,
    AnthropicStreamEvent,
    AnthropicErrorResponse,
    NativeChatResult,
    NativeStreamEvent,
    NativeErrorResponse,
    NativeModelList,
    EmbeddingList,
    RerankResponse,
    ScoreList,
    InputTokens,
    TokenizeResult,
    DetokenizeResult,
    InfillResult,
)

_ERRORS = {
    "400": "Invalid request: bad JSON, wrong Content-Type, or a field missing or out of range "
    "(`param` names it). Also what the worker refuses (for example `tools`).",
    "401": "API keys are configured and the request has no valid `Authorization: Bearer <key>` "
    "(or `x-api-key: <key>`).",
    "404": "Unknown model (`code: model_not_found`) or route.",
    "413": "The body is larger than the edge's `--max-body-bytes`.",
    "422": "The body is valid JSON but not a JSON object.",
    "429": "Every worker's queue is full; retry after `Retry-After` seconds.",
    "500": "An internal error (no detail is shown).",
    "503": "No worker is available; retry after `Retry-After` seconds.",
    "504": "The request's deadline passed before it started.",
}
_RETRY_STATUSES = {"429", "503"}
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


def schema_ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def component_schemas() -> dict[str, Any]:
    """``components/schemas``: every request and response model and the models they use."""
    _, top = models_json_schema(
        [(model, "validation") for model in (*REQUEST_MODELS, *RESPONSE_MODELS)], ref_template=REF
    )
    schemas: dict[str, Any] = top["$defs"]
    return schemas


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


def _generation(
    summary: str, request: type[BaseModel], answer: type[BaseModel], chunk: type[BaseModel]
) -> dict[str, Any]:
    ok = _json(
        answer,
        f"With `stream: false` (the default): one `{answer.__name__}` (`application/json`). "
        "With `stream: true`: `text/event-stream`, one `data: <chunk JSON>` event per chunk "
        f"(`{chunk.__name__}`), ending with `data: [DONE]`; a failure after the stream began is "
        "an `event: error` whose data is an `ErrorResponse`, then `data: [DONE]`; `: heartbeat` "
        "comments keep an idle stream open.",
        "X-Sluice-Worker-ID",
    )
    ok["headers"].update(_headers("Cache-Control"))
    ok["content"]["text/event-stream"] = {
        "schema": {"type": "string", "description": "Server-Sent Events; see the response description."},
        "x-sse-data-schema": schema_ref(chunk),
    }
    statuses = ("400", "401", "404", "413", "422", "429", "500", "503", "504")
    return _post(summary, request, ok, _error_responses(*statuses), [{"bearerAuth": []}], _REQUEST_HEADERS)


_SURFACE_STREAMS = {
    "responses": "one named event per typed Responses event (`event: response.output_text.delta`, "
    "data: a `ResponseStreamEvent` with its `sequence_number`), from `response.created` to "
    "`response.completed` (or `response.incomplete`); a failure after the stream began is an "
    "`error` event then `response.failed`; no `[DONE]`; `: heartbeat` comments keep it open.",
    "messages": "Anthropic's events (`message_start`, `content_block_start`, `content_block_delta`, "
    "`content_block_stop`, `message_delta`, `message_stop`; data: `AnthropicStreamEvent`); a failure "
    "after the stream began is one `error` event (data: `AnthropicErrorResponse`); `ping` events keep "
    "an idle stream open.",
    "native": "named events from `chat.start` to `chat.end` (data: `NativeStreamEvent`; `chat.end`'s "
    "`result` is the non-streaming body); a failure is an `error` event, then `chat.end`; "
    "`: heartbeat` comments keep it open.",
}


def _surface_generation(
    summary: str,
    request: type[BaseModel],
    answer: type[BaseModel],
    event: type[BaseModel],
    error: type[BaseModel],
    stream: str,
    security: list[dict[str, list[str]]],
) -> dict[str, Any]:
    """A generation route of a named-event surface (Responses, Anthropic, native)."""
    ok = _json(
        answer,
        f"With `stream: false` (the default): one `{answer.__name__}` (`application/json`). "
        f"With `stream: true`: `text/event-stream`, {_SURFACE_STREAMS[stream]}",
        "X-Sluice-Worker-ID",
    )
    ok["headers"].update(_headers("Cache-Control"))
    ok["content"]["text/event-stream"] = {
        "schema": {"type": "string", "description": "Server-Sent Events; see the response description."},
        "x-sse-data-schema": schema_ref(event),
    }
    statuses = ("400", "401", "404", "413", "422", "429", "500", "503", "504")
    return _post(summary, request, ok, _error_responses(*statuses, model=error), security)


def _unary(
    summary: str,
    request: type[BaseModel],
    answer: type[BaseModel],
    security: list[dict[str, list[str]]],
    error: type[BaseModel] = ErrorResponse,
    *,
    pooled: bool = False,
) -> dict[str, Any]:
    """A route answered by one unary worker call (no stream): the tokenizer routes, and with
    ``pooled`` the routes the pooling workers serve (embeddings, rerank, score: the timeout headers,
    429 and 504 too)."""
    statuses = ("400", "401", "404", "413", "422", "500", "503") + (("429", "504") if pooled else ())
    ok = _json(answer, f"One `{answer.__name__}`.", "X-Sluice-Worker-ID")
    parameters = _REQUEST_HEADERS if pooled else None
    return _post(summary, request, ok, _error_responses(*statuses, model=error), security, parameters)


def _post(
    summary: str,
    request: type[BaseModel],
    ok: dict[str, Any],
    errors: dict[str, Any],
    security: list[dict[str, list[str]]],
    parameters: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A POST operation taking a JSON ``request`` body: its 200 answer ``ok`` and its ``errors``."""
    operation: dict[str, Any] = {"summary": summary, "security": security}
    if parameters is not None:
        operation["parameters"] = parameters
    operation["requestBody"] = {
        "required": True,
        "content": {"application/json": {"schema": schema_ref(request)}},
    }
    operation["responses"] = {"200": ok, **errors}
    return {"post": operation}


def _generation_llama_cpp() -> dict[str, Any]:
    """``/infill``: llama.cpp's fill-in-the-middle body and answer."""
    route = _unary("Fill-in-the-middle, llama.cpp's shape", InfillRequest, InfillResult, [{"bearerAuth": []}])
    ok = route["post"]["responses"]["200"]
    ok["description"] = (
        "With `stream: false` (the default): one `InfillResult`. With `stream: true`: "
        '`text/event-stream`, one `data: {"content": ..., "stop": false}` event per delta, then '
        "`data: <InfillResult>` (`stop: true`, empty `content`); no `[DONE]`."
    )
    ok["content"]["text/event-stream"] = {
        "schema": {"type": "string", "description": "Server-Sent Events; see the response description."},
        "x-sse-data-schema": schema_ref(InfillResult),
    }
    route["post"]["responses"].update(_error_responses("429", "504"))
    return route


def _pooled(summary: str, request: type[BaseModel], answer: type[BaseModel]) -> dict[str, Any]:
    """A one-answer route served by the pooling workers (embeddings, rerank, score)."""
    return _unary(summary, request, answer, [{"bearerAuth": []}], pooled=True)


_RERANK = (
    "Rerank documents by relevance to a query (Jina's and Cohere's shape, as vLLM serves it); "
    "needs a worker started with --task score or embed"
)


def _playground(summary: str) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "responses": {
                "200": {
                    "description": "The playground page (its script and style sheet are under /static/).",
                    "content": {"text/html": {"schema": {"type": "string"}}},
                }
            },
        }
    }


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The whole document (built once; treat it as read-only)."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Sluice edge",
            "version": "1",
            "description": "OpenAI-compatible HTTP API in front of Sluice gRPC workers. "
            "See docs/http.md for where it differs from OpenAI.",
        },
        "paths": {
            "/v1/chat/completions": _generation(
                "Chat completion", ChatCompletionRequest, ChatCompletion, ChatCompletionChunk
            ),
            "/v1/completions": _generation(
                "Text completion (legacy)", CompletionRequest, TextCompletion, TextCompletionChunk
            ),
            "/v1/embeddings": _pooled(
                "Embeddings (OpenAI); needs a worker started with --task embed",
                EmbeddingRequest,
                EmbeddingList,
            ),
            "/rerank": _pooled(_RERANK, RerankRequest, RerankResponse),
            "/v1/rerank": _pooled(_RERANK, RerankRequest, RerankResponse),
            "/v2/rerank": _pooled(_RERANK, RerankRequest, RerankResponse),
            "/v1/score": _pooled(
                "Scores of text pairs (vLLM's); needs a worker started with --task score or embed",
                ScoreRequest,
                ScoreList,
            ),
            "/v1/responses": _surface_generation(
                "OpenAI Responses API (stateless)",
                ResponsesRequest,
                ResponseObject,
                ResponseStreamEvent,
                ErrorResponse,
                "responses",
                [{"bearerAuth": []}],
            ),
            "/v1/messages": _surface_generation(
                "Anthropic Messages",
                MessagesRequest,
                AnthropicMessage,
                AnthropicStreamEvent,
                AnthropicErrorResponse,
                "messages",
                [{"bearerAuth": []}, {"apiKeyHeader": []}],
            ),
            "/v1/messages/count_tokens": _unary(
                "Anthropic token counting: the prompt tokens of a Messages body",
                CountTokensRequest,
                InputTokens,
                [{"bearerAuth": []}, {"apiKeyHeader": []}],
                AnthropicErrorResponse,
            ),
            "/tokenize": _unary(
                "Token ids of a prompt or a chat (vLLM's shape)",
                TokenizeRequest,
                TokenizeResult,
                [{"bearerAuth": []}],
            ),
            "/detokenize": _unary(
                "The text of token ids (vLLM's shape)",
                DetokenizeRequest,
                DetokenizeResult,
                [{"bearerAuth": []}],
            ),
            "/infill": _generation_llama_cpp(),
            "/api/v1/chat": _surface_generation(
                "Native chat with a stream of named events",
                NativeChatRequest,
                NativeChatResult,
                NativeStreamEvent,
                NativeErrorResponse,
                "native",
                [{"bearerAuth": []}, {"apiKeyHeader": []}],
            ),
            "/api/v1/models": {
                "get": {
                    "summary": "The loaded models, native shape",
                    "security": [{"bearerAuth": []}, {"apiKeyHeader": []}],
                    "responses": {
                        "200": _json(NativeModelList, "The model list.", "X-Sluice-Worker-ID"),
                        **_error_responses("401", "503", model=NativeErrorResponse),
                    },
                }
            },
            "/v1/models": {
                "get": {
                    "summary": "The models the workers serve",
                    "security": [{"bearerAuth": []}],
                    "responses": {
                        "200": _json(ModelList, "The model list.", "X-Sluice-Worker-ID"),
                        **_error_responses("401", "503"),
                    },
                }
            },
            "/v1/models/{model_id}": {
                "get": {
                    "summary": "One model",
                    "security": [{"bearerAuth": []}],
                    "parameters": [
                        {
                            "name": "model_id",
                            "in": "path",
                            "required": True,
                            "description": "The model id; it may contain '/'.",
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {
                        "200": _json(ModelObject, "The model.", "X-Sluice-Worker-ID"),
                        **_error_responses("401", "404", "503"),
                    },
                }
            },
            "/health": {
                "get": {
                    "summary": "Liveness: 200 while the process serves",
                    "responses": {"200": _json(Health, "Alive.")},
                }
            },
            "/ready": {
                "get": {
                    "summary": "Readiness: 200 when a worker is SERVING",
                    "responses": {
                        "200": _json(Readiness, "At least one worker is serving."),
                        "503": _json(Readiness, "No worker is serving (the body has an `error`)."),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics of the edge (no API key needed)",
                    "responses": {
                        "200": {
                            "description": "The Prometheus text exposition format 0.0.4.",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/": _playground("The browser playground (docs/playground.md); no API key needed"),
            "/playground": _playground("The browser playground (the same page as /)"),
            "/openapi.json": {
                "get": {
                    "summary": "This document",
                    "responses": {
                        "200": {
                            "description": "The OpenAPI 3.1 document.",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        }
                    },
                }
            },
        },
        "components": {
            "schemas": component_schemas(),
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
