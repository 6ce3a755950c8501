"""Stored Responses: the record a response keeps (its input items, the conversation a continuation
sends), the earlier turns of ``previous_response_id``, and a view of a record for its owner."""

from __future__ import annotations

import copy
from typing import Any

from edge.errors import InvalidRequestError, NotFoundError
from edge.state import current_state
from edge.store.responses import ResponseStore, StoredResponse
from edge.surfaces.responses.request import ParsedResponsesRequest, input_items
from edge.surfaces.shared.ids import new_id

#: The statuses a response can be continued from.
CONTINUABLE = ("completed", "incomplete")


async def current_store() -> ResponseStore:
    return await current_state().store.get()


async def history_of(previous_id: str | None, owner: str) -> list[Any]:
    """The conversation a continuation of ``previous_id`` starts from (none without one); a 400
    naming ``previous_response_id`` when the owner has no such response that can be continued."""
    if previous_id is None:
        return []
    record = await (await current_store()).get(previous_id, owner)
    if record is None:
        raise InvalidRequestError(
            f"Previous response with id '{previous_id}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    if record.status not in CONTINUABLE:
        raise InvalidRequestError(
            f"Previous response with id '{previous_id}' is {record.status}: only a completed or "
            "incomplete response can be continued.",
            param="previous_response_id",
            code="previous_response_not_usable",
        )
    return record.conversation


def replayable(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the input items of the next turn: a refusal part becomes the
    text it said (the model's turn is rendered as it was), the rest as answered."""
    items = []
    for item in output:
        if item.get("type") == "message":
            parts = [
                {"type": "output_text", "text": part["refusal"]} if part.get("type") == "refusal" else part
                for part in item.get("content", [])
            ]
            item = {**item, "content": parts}
        items.append(item)
    return items


def numbered(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as ``input_items`` lists them: each with an ``id`` and a ``type``; a message's
    string content as one text part."""
    listed = []
    for item in copy.deepcopy(items):
        kind = item.setdefault("type", "message")
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        item.setdefault("id", new_id("msg" if kind == "message" else "item"))
        listed.append(item)
    return listed


def record_of(
    parsed: ParsedResponsesRequest, response: dict[str, Any], owner: str, history: list[Any]
) -> StoredResponse:
    """The record of ``response`` (its current state) for ``owner``."""
    return StoredResponse(
        id=response["id"],
        owner=owner,
        created_at=response["created_at"],
        status=response["status"],
        background=bool(response["background"]),
        response=response,
        input_items=numbered(input_items(parsed.request)),
        conversation=[*history, *input_items(parsed.request), *replayable(response["output"])],
    )


async def owned(response_id: str, owner: str) -> StoredResponse:
    """The owner's response ``response_id``; a 404 when there is none (another key's response is
    none)."""
    record = await (await current_store()).get(response_id, owner)
    if record is None:
        raise NotFoundError(f"No response found with id '{response_id}'.", param="response_id")
    return record


def ended(response: dict[str, Any], status: str, error: dict[str, str] | None = None) -> dict[str, Any]:
    """``response`` with a final ``status`` (and ``error``)."""
    return {**response, "status": status, "error": error}
