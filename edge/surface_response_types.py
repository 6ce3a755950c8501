"""Pydantic models of the bodies and events of the Responses, Anthropic and native surfaces.

Like :mod:`edge.response_types`, these only describe what the translators
(:mod:`edge.translate_responses`, :mod:`edge.translate_anthropic`,
:mod:`edge.translate_native`) build as dicts, for the OpenAPI document; they
forbid extra keys, so tests that validate real answers catch any key the
document does not list. A stream event model lists every key an event of its
surface may carry; which keys each event type has is in docs/http.md.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- Responses

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputTextPart(_Out):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class RefusalPart(_Out):
    type: Literal["refusal"]
    refusal: str


class ReasoningTextPart(_Out):
    type: Literal["reasoning_text"]
    text: str


class ResponseMessageItem(_Out):
    type: Literal["message"]
    id: str
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputTextPart | RefusalPart]


class ResponseReasoningItem(_Out):
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ReasoningTextPart]
    status: ItemStatus


class ResponseFunctionCallItem(_Out):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str = Field(description="JSON text of the arguments.")
    status: ItemStatus


class ResponseInputTokensDetails(_Out):
    cached_tokens: int
    cache_write_tokens: int


class ResponseOutputTokensDetails(_Out):
    reasoning_tokens: int


class ResponseUsage(_Out):
    input_tokens: int
    input_tokens_details: ResponseInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponseOutputTokensDetails
    total_tokens: int


class ResponseError(_Out):
    code: str
    message: str


class ResponseObject(_Out):
    """A Response: the ``stream: false`` answer of ``/v1/responses``, and the ``response`` of
    its lifecycle events. Request fields are echoed back."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    background: bool
    error: ResponseError | None
    incomplete_details: dict[str, str] | None = Field(
        description="{'reason': 'max_output_tokens'} and the like."
    )
    model: str
    output: list[ResponseMessageItem | ResponseReasoningItem | ResponseFunctionCallItem]
    previous_response_id: None
    store: Literal[False]
    truncation: Literal["disabled"]
    usage: ResponseUsage | None
    instructions: str | None
    max_output_tokens: int | None
    parallel_tool_calls: bool
    reasoning: dict[str, Any]
    temperature: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float | None
    user: str | None
    metadata: dict[str, str]


class ResponseStreamEvent(_Out):
    """One ``event: <type>`` of a streamed ``/v1/responses`` answer (its ``data`` JSON)."""

    type: Literal[
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.refusal.delta",
        "response.refusal.done",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
        "response.incomplete",
        "response.failed",
        "error",
    ]
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    item: ResponseMessageItem | ResponseReasoningItem | ResponseFunctionCallItem | None = None
    item_id: str | None = None
    content_index: int | None = None
    part: OutputTextPart | RefusalPart | ReasoningTextPart | None = None
    delta: str | None = None
    text: str | None = None
    refusal: str | None = None
    logprobs: list[Any] | None = None
    name: str | None = None
    arguments: str | None = None
    code: str | None = None
    message: str | None = None
    param: str | None = None


# ---------------------------------------------------------------- Anthropic


class AnthropicTextBlock(_Out):
    type: Literal["text"]
    text: str


class AnthropicThinkingBlock(_Out):
    type: Literal["thinking"]
    thinking: str
    signature: str


class AnthropicToolUseBlock(_Out):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


AnthropicBlock = AnthropicTextBlock | AnthropicThinkingBlock | AnthropicToolUseBlock


class AnthropicUsage(_Out):
    input_tokens: int = Field(description="Prompt tokens not read from the prefix cache.")
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int


class AnthropicMessage(_Out):
    """The ``stream: false`` answer of ``/v1/messages`` (and ``message_start``'s message)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal"] | None
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicErrorBody(_Out):
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, ...")
    message: str


class AnthropicErrorResponse(_Out):
    """Every ``/v1/messages`` error: a plain JSON answer, or the data of a mid-stream ``error`` event."""

    type: Literal["error"]
    error: AnthropicErrorBody


class AnthropicDelta(_Out):
    type: Literal["text_delta", "thinking_delta", "input_json_delta"] | None = None
    text: str | None = None
    thinking: str | None = None
    partial_json: str | None = None
    stop_reason: str | None = None
    stop_sequence: str | None = None


class AnthropicStreamEvent(_Out):
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


# ------------------------------------------------------------------- native


class NativeStats(_Out):
    input_tokens: int
    total_output_tokens: int
    reasoning_output_tokens: int
    tokens_per_second: float
    time_to_first_token_seconds: float


class NativeOutputItem(_Out):
    type: Literal["reasoning", "message", "tool_call", "invalid_tool_call"]
    content: str | None = Field(default=None, description="reasoning and message items")
    tool: str | None = Field(default=None, description="tool_call items")
    arguments: dict[str, Any] | None = Field(
        default=None, description="tool_call items: the parsed arguments"
    )
    reason: str | None = Field(default=None, description="invalid_tool_call items")
    metadata: dict[str, Any] | None = Field(default=None, description="invalid_tool_call items")


class NativeChatResult(_Out):
    """The ``stream: false`` answer of ``/api/v1/chat`` (and ``chat.end``'s ``result``)."""

    model_instance_id: str
    output: list[NativeOutputItem]
    stats: NativeStats
    stop_reason: Literal["stop", "max_output_tokens", "tool_calls", "content_filter"]
    response_id: str


class NativeErrorBody(_Out):
    type: Literal["invalid_request", "model_not_found", "internal_error", "unknown"]
    message: str
    code: str | None
    param: str | None


class NativeErrorResponse(_Out):
    """Every ``/api/v1/*`` error answered before a stream began."""

    error: NativeErrorBody


class NativeStreamEvent(_Out):
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


class NativeModel(_Out):
    type: Literal["llm"]
    key: str
    display_name: str
    owned_by: str
    max_context_length: int | None
    loaded_instances: list[dict[str, str]]


class NativeModelList(_Out):
    """``GET /api/v1/models``."""

    models: list[NativeModel]
