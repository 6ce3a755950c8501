"""The text completion and chunk bodies, as pydantic models for the OpenAPI document."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from edge.requests.models import ResponseModel
from edge.surfaces.shared.finish import FinishReason
from edge.surfaces.shared.usage import Usage


class LegacyLogprobs(ResponseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] = Field(
        description="Per token: the requested alternatives and the sampled token, text → logprob."
    )
    text_offset: list[int] = Field(description="Character offset of each token in the choice's text.")


class TextChoice(ResponseModel):
    text: str
    index: int = Field(description="prompt_index * n + choice")
    logprobs: LegacyLogprobs | None
    finish_reason: FinishReason | None


class TextCompletion(ResponseModel):
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
