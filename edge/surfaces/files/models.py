"""The Files API's answers, as pydantic models for the OpenAPI document."""

from __future__ import annotations

from typing import Literal

from edge.requests.models import ResponseModel


class FileObject(ResponseModel):
    """An uploaded (``purpose: batch``) or produced (``batch_output``) file."""

    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    expires_at: int | None
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"]
    status_details: None


class FileList(ResponseModel):
    """A page of the caller's files (``GET /v1/files``)."""

    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(ResponseModel):
    """The answer of ``DELETE /v1/files/{file_id}``."""

    id: str
    object: Literal["file"]
    deleted: Literal[True]


class FileUploadRequest(ResponseModel):
    """The multipart form of ``POST /v1/files``."""

    file: bytes
    purpose: Literal["batch"]
