"""The Batch API's request and answers, as pydantic models (the request's validation, the OpenAPI
document)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from edge.requests.models import RequestModel, ResponseModel
from edge.requests.validation import metadata_limits
from edge.surfaces.batches.lines import ENDPOINTS

Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
assert set(Endpoint.__args__) == set(ENDPOINTS)  # type: ignore[attr-defined]
Status = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]


class BatchCreateRequest(RequestModel):
    """``POST /v1/batches``."""

    input_file_id: str
    endpoint: Endpoint
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None

    _metadata = field_validator("metadata")(metadata_limits)


class BatchError(ResponseModel):
    code: str
    message: str
    param: str | None
    line: int | None


class BatchErrors(ResponseModel):
    object: Literal["list"]
    data: list[BatchError]


class RequestCounts(ResponseModel):
    total: int
    completed: int
    failed: int


class BatchObject(ResponseModel):
    """A batch as OpenAI answers it."""

    id: str
    object: Literal["batch"]
    endpoint: Endpoint
    errors: BatchErrors | None
    input_file_id: str
    completion_window: Literal["24h"]
    status: Status
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = Field(default=None)


class BatchList(ResponseModel):
    """A page of the caller's batches (``GET /v1/batches``), newest first."""

    object: Literal["list"]
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool
