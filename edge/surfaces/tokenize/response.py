"""The ``/tokenize`` and ``/detokenize`` answers, as pydantic models for the OpenAPI document."""

from __future__ import annotations

from pydantic import Field

from edge.requests.models import ResponseModel


class TokenizeResult(ResponseModel):
    count: int = Field(description="The number of tokens.")
    max_model_len: int = Field(description="The model's context length.")
    tokens: list[int]
    token_strs: list[str] | None = Field(
        default=None, description="With return_token_strs: each token's text."
    )


class DetokenizeResult(ResponseModel):
    prompt: str = Field(description="The text of the tokens.")
