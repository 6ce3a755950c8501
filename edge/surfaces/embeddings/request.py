"""The OpenAI embeddings request, validated: ``input`` as a string, strings, token ids or lists of
token ids; ``encoding_format`` float or base64; ``dimensions``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from edge.requests.models import RequestModel
from edge.requests.validation import invalid, text_or_tokens_shapes, validate_body
from sluice.limits import INT32_MAX, MAX_POOLED_INPUTS
from sluice.v1 import worker_pb2

# OpenAI's bound on the inputs of one request (the worker's too).

EmbeddingInput = str | list[int]
_InputShapes = text_or_tokens_shapes(MAX_POOLED_INPUTS)


class EmbeddingRequest(RequestModel):
    """A validated ``POST /v1/embeddings`` body."""

    model: str
    input: list[EmbeddingInput]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(
        default=None,
        ge=1,
        le=INT32_MAX,
        description="Served when it is the model's own size or one of its Matryoshka sizes; else a 400.",
    )
    user: str | None = None

    @field_validator("input", mode="before", json_schema_input_type=_InputShapes)
    @classmethod
    def _inputs(cls, value: Any) -> Any:
        return normalize_input(value)


def normalize_input(value: Any) -> list[EmbeddingInput]:
    """The accepted ``input`` shapes as a list of inputs; raises a validation error otherwise."""
    one_list = isinstance(value, list) and value and all(_is_token(item) for item in value)
    if isinstance(value, str) or one_list:
        value = [value]
    if not isinstance(value, list) or not value:
        raise invalid("must be a string, a list of strings, a list of token ids or a list of such lists")
    if len(value) > MAX_POOLED_INPUTS:
        raise invalid(f"at most {MAX_POOLED_INPUTS} inputs per request, got {len(value)}")
    for index, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise invalid(f"input[{index}] is an empty string")
        elif isinstance(item, list):
            if not item or not all(_is_token(token) for token in item):
                raise invalid(f"input[{index}] must be a non-empty list of token ids (integers >= 0)")
        else:
            raise invalid(f"input[{index}] must be a string or a list of token ids")
    return list(value)


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= INT32_MAX


def parse_embedding_request(body: Any) -> EmbeddingRequest:
    """Validates a decoded JSON body; raises :class:`~edge.errors.InvalidRequestError` naming the field."""
    return validate_body(EmbeddingRequest, body)


def to_embed_request(request: EmbeddingRequest, request_id: str) -> worker_pb2.EmbedRequest:
    inputs = [
        worker_pb2.EmbedInput(text=item)
        if isinstance(item, str)
        else worker_pb2.EmbedInput(token_ids=worker_pb2.TokenIds(ids=item))
        for item in request.input
    ]
    return worker_pb2.EmbedRequest(
        request_id=request_id, model=request.model, inputs=inputs, dimensions=request.dimensions or 0
    )
