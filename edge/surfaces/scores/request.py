"""The rerank and score requests, validated, and the worker's ``ScoreRequest`` built from them."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, StrictBool, field_validator

from edge.requests.models import RequestModel
from edge.requests.validation import bad, invalid, validate_body
from sluice.limits import MAX_POOLED_INPUTS
from sluice.v1 import worker_pb2

_Text = Annotated[str, Field(min_length=1)]


class RerankDocument(RequestModel):
    """A document as an object (Jina's and Cohere's clients may send ``{"text": ...}``)."""

    text: _Text


class RerankRequest(RequestModel):
    """A validated rerank body: ``query`` against each of ``documents``."""

    model: str = Field(default="", description="Empty: any worker that scores.")
    query: _Text
    documents: Annotated[list[_Text | RerankDocument], Field(min_length=1, max_length=MAX_POOLED_INPUTS)]
    top_n: int | None = Field(default=None, ge=0, description="The best this many (0 or absent: all).")
    return_documents: StrictBool = True
    # Cohere v2 sends it; every document is scored whole (a too-long one is refused).
    max_tokens_per_doc: int | None = Field(default=None, ge=1)

    @property
    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(RequestModel):
    """A validated ``POST /v1/score`` body (vLLM's): ``text_1`` paired with each ``text_2``, or the
    two lists paired in order."""

    model: str = Field(default="", description="Empty: any worker that scores.")
    text_1: _Text | Annotated[list[_Text], Field(min_length=1, max_length=MAX_POOLED_INPUTS)]
    text_2: _Text | Annotated[list[_Text], Field(min_length=1, max_length=MAX_POOLED_INPUTS)]

    @field_validator("text_1", "text_2", mode="before")
    @classmethod
    def _texts(cls, value: Any) -> Any:
        if isinstance(value, list) and not all(isinstance(item, str) for item in value):
            raise invalid("must be a string or a list of strings")
        return value

    def pairs(self) -> list[tuple[str, str]]:
        firsts = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        seconds = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise bad(
                "text_2",
                f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: "
                "give one text_1, or as many as text_2",
            )
        return list(zip(firsts, seconds, strict=True))


def parse_rerank_request(body: Any) -> RerankRequest:
    return validate_body(RerankRequest, body)


def parse_score_request(body: Any) -> tuple[ScoreRequest, list[tuple[str, str]]]:
    request = validate_body(ScoreRequest, body)
    return request, request.pairs()


def to_score_request(model: str, pairs: list[tuple[str, str]], request_id: str) -> worker_pb2.ScoreRequest:
    return worker_pb2.ScoreRequest(
        request_id=request_id,
        model=model,
        pairs=[worker_pb2.ScorePair(text_1=first, text_2=second) for first, second in pairs],
    )
