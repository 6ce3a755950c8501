"""The Anthropic message, error and stream events, as pydantic models for the OpenAPI document."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from edge.requests.models import ResponseModel


class AnthropicTextBlock(ResponseModel):
    type: Literal["text"]
    text: str


class AnthropicThinkingBlock(ResponseModel):
    type: Literal["thinking"]
    thinking: str
    signature: str


class AnthropicToolUseBlock(ResponseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


AnthropicBlock = AnthropicTextBlock | AnthropicThinkingBlock | AnthropicToolUseBlock


class AnthropicUsage(ResponseModel):
    input_tokens: int = Field(description="Prompt tokens not read from the prefix cache.")
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int


class AnthropicMessage(ResponseModel):
    """The ``stream: false`` answer of ``/v1/messages`` (and ``message_start``'s message)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal"] | None
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicErrorBody(ResponseModel):
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, ...")
    message: str


class AnthropicErrorResponse(ResponseModel):
    """Every ``/v1/messages`` error: a plain JSON answer, or the data of a mid-stream ``error`` event."""

    type: Literal["error"]
    error: AnthropicErrorBody


class AnthropicDelta(ResponseModel):
    type: Literal["text_delta", "thinking_delta", "input_json_delta"] | None = None
    text: str | None = None
    thinking: str | None = None
    partial_json: str | None = None
    stop_reason: str | None = None
    stop_sequence: str | None = None


class AnthropicStreamEvent(ResponseModel):
    """One ``event: <type>`` of a streamed ``/v1/messages`` answer (its ``data`` JSON)."""

    type: Literal[
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
        "ping",
        "error",
    ]
    message: AnthropicMessage | None = None
    index: int | None = None
    content_block: AnthropicBlock | None = None
    delta: AnthropicDelta | None = None
    usage: AnthropicUsage | None = None
    error: AnthropicErrorBody | None = None


class InputTokens(ResponseModel):
    """The ``/v1/messages/count_tokens`` answer."""

    input_tokens: int
