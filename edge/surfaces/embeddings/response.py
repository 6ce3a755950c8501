"""The OpenAI embeddings answer, as pydantic models for the OpenAPI document, and its building."""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from pydantic import Field

from edge.requests.models import ResponseModel
from sluice.v1 import worker_pb2


class Embedding(ResponseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(
        description="The vector; with encoding_format base64, its little-endian float32 bytes in base64."
    )


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(ResponseModel):
    """A ``POST /v1/embeddings`` answer."""

    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def embedding_list(reply: worker_pb2.EmbedResponse, model: str, encoding_format: str) -> dict[str, Any]:
    data = [
        {"object": "embedding", "index": index, "embedding": _encode(list(item.values), encoding_format)}
        for index, item in enumerate(reply.embeddings)
    ]
    usage = {"prompt_tokens": reply.prompt_tokens, "total_tokens": reply.prompt_tokens}
    return {"object": "list", "data": data, "model": model or reply.model, "usage": usage}


def _encode(values: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values
