"""The native chat result, errors, events and model list, as pydantic models for the OpenAPI document."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from edge.requests.models import ResponseModel


class NativeStats(ResponseModel):
    input_tokens: int
    total_output_tokens: int
    reasoning_output_tokens: int
    tokens_per_second: float
    time_to_first_token_seconds: float


class NativeOutputItem(ResponseModel):
    type: Literal["reasoning", "message", "tool_call", "invalid_tool_call"]
    content: str | None = Field(default=None, description="reasoning and message items")
    tool: str | None = Field(default=None, description="tool_call items")
    arguments: dict[str, Any] | None = Field(
        default=None, description="tool_call items: the parsed arguments"
    )
    reason: str | None = Field(default=None, description="invalid_tool_call items")
    metadata: dict[str, Any] | None = Field(default=None, description="invalid_tool_call items")


class NativeChatResult(ResponseModel):
    """The ``stream: false`` answer of ``/api/v1/chat`` (and ``chat.end``'s ``result``)."""

    model_instance_id: str
    output: list[NativeOutputItem]
    stats: NativeStats
    stop_reason: Literal["stop", "max_output_tokens", "tool_calls", "content_filter"]
    response_id: str


class NativeErrorBody(ResponseModel):
    type: Literal["invalid_request", "model_not_found", "internal_error", "unknown"]
    message: str
    code: str | None
    param: str | None


class NativeErrorResponse(ResponseModel):
    """Every ``/api/v1/*`` error answered before a stream began."""

    error: NativeErrorBody


class NativeStreamEvent(ResponseModel):
    """One ``event: <type>`` of a streamed ``/api/v1/chat`` answer (its ``data`` JSON)."""

    type: Literal[
        "chat.start",
        "model_load.start",
        "model_load.progress",
        "model_load.end",
        "prompt_processing.start",
        "prompt_processing.progress",
        "prompt_processing.end",
        "reasoning.start",
        "reasoning.delta",
        "reasoning.end",
        "tool_call.start",
        "tool_call.arguments",
        "tool_call.failure",
        "message.start",
        "message.delta",
        "message.end",
        "error",
        "chat.end",
    ]
    model_instance_id: str | None = None
    progress: float | None = None
    content: str | None = None
    tool: str | None = None
    arguments: dict[str, Any] | None = None
    reason: str | None = None
    metadata: dict[str, Any] | None = None
    error: NativeErrorBody | None = None
    result: NativeChatResult | None = None


class NativeModel(ResponseModel):
    type: Literal["llm"]
    key: str
    display_name: str
    owned_by: str
    max_context_length: int | None
    loaded_instances: list[dict[str, str]]


class NativeModelList(ResponseModel):
    """``GET /api/v1/models``."""

    models: list[NativeModel]
