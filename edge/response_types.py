"""Pydantic models of every body the edge sends, for the OpenAPI document.

The edge builds its answers as plain dicts (:mod:`edge.translate`,
:mod:`edge.translate_completions`); these models only describe them. They
forbid extra keys, so tests that validate real answers against the generated
schemas catch any key the document does not list. A field with a default may
be absent from an answer (for example ``delta.role`` after the first chunk,
or ``usage`` on chunks when no usage was asked for).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length", "tool_calls", "content_filter"]


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ------------------------------------------------------------------- errors


class ErrorBody(_Out):
    message: str
    type: str = Field(description="invalid_request_error, rate_limit_error, server_error, api_error, ...")
    param: str | None = Field(description="The request field at fault (a path like messages[0].role).")
    code: str | None = Field(description="A machine-readable code (invalid_value, invalid_api_key, ...).")


class ErrorResponse(_Out):
    """Every error, before a stream began (a plain JSON answer) or in a mid-stream ``event: error``."""

    error: ErrorBody


# ------------------------------------------------------------------- shared


class PromptTokensDetails(_Out):
    cached_tokens: int


class CompletionTokensDetails(_Out):
    reasoning_tokens: int


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="The token's exact UTF-8 bytes (may be part of a character).")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Out):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None


# --------------------------------------------------------------------- chat


class FunctionCallOut(_Out):
    name: str
    arguments: str


class ToolCallOut(_Out):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(_Out):
    """A non-streaming chat answer."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None
    service_tier: str | None
    choices: list[ChatChoice]
    usage: Usage


class ChunkFunction(_Out):
    name: str | None = None
    arguments: str | None = None


class ChunkToolCall(_Out):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ChunkFunction


class ChunkDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    tool_calls: list[ChunkToolCall] | None = None


class ChunkChoice(_Out):
    index: int
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(_Out):
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


# ---------------------------------------------------------------- completions


class LegacyLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] = Field(
        description="Per token: the requested alternatives and the sampled token, text → logprob."
    )
    text_offset: list[int] = Field(description="Character offset of each token in the choice's text.")


class TextChoice(_Out):
    text: str
    index: int = Field(description="prompt_index * n + choice")
    logprobs: LegacyLogprobs | None
    finish_reason: FinishReason | None


class TextCompletion(_Out):
    """A non-streaming completions answer, or (with ``usage`` optional) one streamed chunk."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[TextChoice]
    usage: Usage


class TextCompletionChunk(TextCompletion):
    """One ``data:`` event of a streaming completions answer."""

    usage: Usage | None = Field(  # type: ignore[assignment]
        default=None, description="As for chat chunks: absent unless stream_options asked for usage."
    )


# ------------------------------------------------------------- models, health


class ModelObject(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelObject]


class Health(_Out):
    status: Literal["ok"]


class WorkerState(_Out):
    address: str
    status: Literal["SERVING", "NOT_SERVING", "LOADING", "UNKNOWN", "UNREACHABLE", "SERVICE_UNKNOWN"]
    outstanding: int
    # While LOADING: how far the worker's model load has come (0 to 1), when it said.
    load_fraction: float | None = None


class Readiness(_Out):
    """``/ready``: 200 with ``status: ready``, or 503 with ``status: not_ready`` and an ``error``."""

    status: Literal["ready", "not_ready"]
    workers: list[WorkerState]
    error: ErrorBody | None = None
