"""The Response object and stream events, as pydantic models for the OpenAPI document.

They only describe what :mod:`edge.surfaces.responses.translate` builds as dicts (extra
keys forbidden); which keys each event type has is in docs/http.md.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from edge.requests.models import ResponseModel

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputTextPart(ResponseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class RefusalPart(ResponseModel):
    type: Literal["refusal"]
    refusal: str


class ReasoningTextPart(ResponseModel):
    type: Literal["reasoning_text"]
    text: str


class ResponseMessageItem(ResponseModel):
    type: Literal["message"]
    id: str
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputTextPart | RefusalPart]


class ResponseReasoningItem(ResponseModel):
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ReasoningTextPart]
    status: ItemStatus


class ResponseFunctionCallItem(ResponseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str = Field(description="JSON text of the arguments.")
    status: ItemStatus


class ResponseInputTokensDetails(ResponseModel):
    cached_tokens: int
    cache_write_tokens: int


class ResponseOutputTokensDetails(ResponseModel):
    reasoning_tokens: int


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: ResponseInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponseOutputTokensDetails
    total_tokens: int


class ResponseError(ResponseModel):
    code: str
    message: str


class ResponseObject(ResponseModel):
    """A Response: the ``stream: false`` answer of ``/v1/responses``, and the ``response`` of
    its lifecycle events. Request fields are echoed back."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    background: bool
    error: ResponseError | None
    incomplete_details: dict[str, str] | None = Field(
        description="{'reason': 'max_output_tokens'} and the like."
    )
    model: str
    output: list[ResponseMessageItem | ResponseReasoningItem | ResponseFunctionCallItem]
    previous_response_id: str | None
    conversation: dict[str, str] | None
    store: bool
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


class ResponseStreamEvent(ResponseModel):
    """One ``event: <type>`` of a streamed ``/v1/responses`` answer (its ``data`` JSON)."""

    type: Literal[
        "response.queued",
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


class ResponseDeleted(ResponseModel):
    """The answer of ``DELETE /v1/responses/{response_id}``."""

    id: str
    object: Literal["response.deleted"]
    deleted: Literal[True]


class InputItemList(ResponseModel):
    """A page of a stored response's input items (``GET /v1/responses/{response_id}/input_items``):
    the items as sent (a string input as one user message), each with an ``id``."""

    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
