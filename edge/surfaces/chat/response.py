"""The chat completion and chunk bodies, as pydantic models for the OpenAPI document.

The translator builds answers as plain dicts; these models only describe them
(extra keys forbidden, so tests validating real answers catch an undocumented key).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from edge.requests.models import ResponseModel
from edge.surfaces.shared.finish import FinishReason
from edge.surfaces.shared.usage import Usage


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="The token's exact UTF-8 bytes (may be part of a character).")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(ResponseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None


class FunctionCallOut(ResponseModel):
    name: str
    arguments: str


class ToolCallOut(ResponseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(ResponseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None


class ChatChoice(ResponseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(ResponseModel):
    """A non-streaming chat answer."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None
    service_tier: str | None
    choices: list[ChatChoice]
    usage: Usage


class ChunkFunction(ResponseModel):
    name: str | None = None
    arguments: str | None = None


class ChunkToolCall(ResponseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ChunkFunction


class ChunkDelta(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    tool_calls: list[ChunkToolCall] | None = None


class ChunkChoice(ResponseModel):
    index: int
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(ResponseModel):
    """One ``data:`` event of a streaming chat answer."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str | None
    service_tier: str | None
    choices: list[ChunkChoice]
    usage: Usage | None = Field(
        default=None,
        description="Absent unless stream_options asked for usage: null on every chunk but the last "
        "(include_usage), or the usage so far on every chunk (continuous_usage_stats).",
    )
