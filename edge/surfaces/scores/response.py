"""The rerank and score answers, as pydantic models for the OpenAPI document, and their building."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from edge.requests.models import ResponseModel
from edge.surfaces.scores.request import RerankRequest
from edge.surfaces.shared.ids import new_id
from sluice.v1 import worker_pb2


class RerankDocumentOut(ResponseModel):
    text: str


class RerankResult(ResponseModel):
    index: int = Field(description="The document's position in the request.")
    relevance_score: float
    document: RerankDocumentOut | None = Field(
        default=None, description="Absent when return_documents is false."
    )


class ScoreUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(ResponseModel):
    """A rerank answer: the documents best first."""

    id: str
    model: str
    usage: ScoreUsage
    results: list[RerankResult]


class ScoreData(ResponseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreList(ResponseModel):
    """A ``POST /v1/score`` answer: one score per pair, in pair order."""

    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


def _usage(reply: worker_pb2.ScoreResponse) -> dict[str, int]:
    return {"prompt_tokens": reply.prompt_tokens, "total_tokens": reply.prompt_tokens}


def rerank_response(reply: worker_pb2.ScoreResponse, request: RerankRequest) -> dict[str, Any]:
    texts = request.texts
    order = sorted(range(len(texts)), key=lambda i: -reply.scores[i])
    if request.top_n:
        order = order[: request.top_n]
    results: list[dict[str, Any]] = []
    for index in order:
        result: dict[str, Any] = {"index": index, "relevance_score": reply.scores[index]}
        if request.return_documents:
            result["document"] = {"text": texts[index]}
        results.append(result)
    return {"id": new_id("rerank", "-"), "model": reply.model, "usage": _usage(reply), "results": results}


def score_list(reply: worker_pb2.ScoreResponse) -> dict[str, Any]:
    data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(reply.scores)]
    return {
        "id": new_id("score", "-"),
        "object": "list",
        "created": int(time.time()),
        "model": reply.model,
        "data": data,
        "usage": _usage(reply),
    }
