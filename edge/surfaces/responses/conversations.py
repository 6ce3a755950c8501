"""``/v1/conversations``: create, read, update and delete the caller's conversations, and list, add,
read and delete their items; ``/v1/responses`` with ``conversation`` appends each turn
(:mod:`edge.surfaces.responses.turns`)."""

from __future__ import annotations

from typing import Any

from quart import Blueprint, request
from quart.wrappers import Response

from edge.auth import caller_key_id
from edge.errors import NotFoundError
from edge.http import json_response, read_json_body
from edge.openapi import Read, Unary, documented
from edge.requests.validation import validate_body
from edge.state import current_state
from edge.store.conversations import ConversationRecord, ConversationStore
from edge.store.responses import now_ms
from edge.surfaces.responses.conversation_models import (
    ConversationCreateRequest,
    ConversationDeleted,
    ConversationItem,
    ConversationItemList,
    ConversationObject,
    ConversationUpdateRequest,
    ItemsCreateRequest,
)
from edge.surfaces.responses.request import check_items
from edge.surfaces.responses.stored import numbered
from edge.surfaces.shared.ids import new_id
from edge.surfaces.shared.paging import PAGE_QUERY, item_page

blueprint = Blueprint("conversations", __name__)
_ID = {"conversation_id": "The conversation's id (`conv_...`)."}
_ITEM = {**_ID, "item_id": "The item's id."}
_STATUSES = ("400", "401", "404")


async def _store() -> ConversationStore:
    return await current_state().store.conversations()


async def owned(store: ConversationStore, conversation_id: str, owner: str) -> ConversationRecord:
    """The owner's conversation; a 404 when there is none (another key's conversation is none)."""
    record = await store.get(conversation_id, owner)
    if record is None:
        raise NotFoundError(f"Conversation with id '{conversation_id}' not found.", param="conversation_id")
    return record


def _items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items checked as ``/v1/responses`` checks its ``input`` (a 400 naming ``items[i]``),
    each with an ``id``."""
    check_items(items, "items")
    return numbered(items)


@blueprint.post("/v1/conversations")
@documented(
    Unary("Creates a conversation, with its first items", ConversationCreateRequest, ConversationObject)
)
async def create_conversation() -> Response:
    body = validate_body(ConversationCreateRequest, await read_json_body())
    items = _items(body.items) if body.items else []
    record = ConversationRecord(new_id("conv"), caller_key_id(), now_ms() // 1000, body.metadata or {})
    await (await _store()).create(record, items)
    return json_response(record.answer())


@blueprint.get("/v1/conversations/<conversation_id>")
@documented(Read("A conversation", ConversationObject, "The conversation.", _STATUSES, path_parameters=_ID))
async def retrieve_conversation(conversation_id: str) -> Response:
    return json_response((await owned(await _store(), conversation_id, caller_key_id())).answer())


@blueprint.post("/v1/conversations/<conversation_id>")
@documented(
    Unary(
        "Replaces a conversation's metadata",
        ConversationUpdateRequest,
        ConversationObject,
        path_parameters=_ID,
    )
)
async def update_conversation(conversation_id: str) -> Response:
    body = validate_body(ConversationUpdateRequest, await read_json_body())
    store, owner = await _store(), caller_key_id()
    record = await owned(store, conversation_id, owner)
    await store.update(conversation_id, owner, body.metadata)
    record.metadata = body.metadata
    return json_response(record.answer())


@blueprint.delete("/v1/conversations/<conversation_id>")
@documented(
    Read(
        "Deletes a conversation and its items",
        ConversationDeleted,
        "It was deleted.",
        _STATUSES,
        path_parameters=_ID,
    )
)
async def delete_conversation(conversation_id: str) -> Response:
    if not await (await _store()).delete(conversation_id, caller_key_id()):
        raise NotFoundError(f"Conversation with id '{conversation_id}' not found.", param="conversation_id")
    return json_response({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


@blueprint.get("/v1/conversations/<conversation_id>/items")
@documented(
    Read(
        "A conversation's items, a page at a time",
        ConversationItemList,
        "A page of items.",
        _STATUSES,
        path_parameters=_ID,
        query_parameters=PAGE_QUERY,
    )
)
async def list_items(conversation_id: str) -> Response:
    store = await _store()
    await owned(store, conversation_id, caller_key_id())
    args = request.args
    return json_response(
        item_page(await store.items(conversation_id), args.get("limit"), args.get("order"), args.get("after"))
    )


@blueprint.post("/v1/conversations/<conversation_id>/items")
@documented(
    Unary(
        "Adds items after a conversation's last",
        ItemsCreateRequest,
        ConversationItemList,
        path_parameters=_ID,
    )
)
async def create_items(conversation_id: str) -> Response:
    body = validate_body(ItemsCreateRequest, await read_json_body())
    store = await _store()
    await owned(store, conversation_id, caller_key_id())
    items = _items(body.items)
    await store.append(conversation_id, items)
    return json_response(item_page(items, "100", "asc", None))


@blueprint.get("/v1/conversations/<conversation_id>/items/<item_id>")
@documented(
    Read("One item of a conversation", ConversationItem, "The item.", _STATUSES, path_parameters=_ITEM)
)
async def retrieve_item(conversation_id: str, item_id: str) -> Response:
    store = await _store()
    await owned(store, conversation_id, caller_key_id())
    for item in await store.items(conversation_id):
        if item["id"] == item_id:
            return json_response(item)
    raise NotFoundError(f"Item with id '{item_id}' not found.", param="item_id")


@blueprint.delete("/v1/conversations/<conversation_id>/items/<item_id>")
@documented(
    Read(
        "Deletes one item of a conversation",
        ConversationObject,
        "The conversation, without the item.",
        _STATUSES,
        path_parameters=_ITEM,
    )
)
async def delete_item(conversation_id: str, item_id: str) -> Response:
    store = await _store()
    record = await owned(store, conversation_id, caller_key_id())
    if not await store.delete_item(conversation_id, item_id):
        raise NotFoundError(f"Item with id '{item_id}' not found.", param="item_id")
    return json_response(record.answer())
