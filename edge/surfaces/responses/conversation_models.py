"""The Conversations API's requests and answers, as pydantic models (the requests' validation, the
OpenAPI document)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from edge.requests.models import RequestModel, ResponseModel
from edge.requests.validation import metadata_limits

#: OpenAI's limit on the items one request adds.
MAX_ITEMS = 20


class ConversationCreateRequest(RequestModel):
    """``POST /v1/conversations``: its first items (input items, as ``/v1/responses`` takes them)
    and metadata."""

    items: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_ITEMS)
    metadata: dict[str, str] | None = None

    _metadata = field_validator("metadata")(metadata_limits)


class ConversationUpdateRequest(RequestModel):
    """``POST /v1/conversations/{conversation_id}``: the metadata that replaces the old."""

    metadata: dict[str, str]

    _metadata = field_validator("metadata")(metadata_limits)


class ItemsCreateRequest(RequestModel):
    """``POST /v1/conversations/{conversation_id}/items``: items added after the last."""

    items: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_ITEMS)


class ConversationObject(ResponseModel):
    id: str
    object: Literal["conversation"]
    created_at: int
    metadata: dict[str, str]


class ConversationDeleted(ResponseModel):
    id: str
    object: Literal["conversation.deleted"]
    deleted: bool


class ConversationItem(ResponseModel):
    """One item (a message, a function call or its output, reasoning), as stored, with its id."""

    model_config = {"extra": "allow"}

    id: str
    type: str


class ConversationItemList(ResponseModel):
    """A page of a conversation's items (or the items one request added)."""

    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
