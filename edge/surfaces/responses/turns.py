"""``/v1/responses`` with ``conversation``: the conversation's items are the earlier turns of the
prompt (rendered as they were, so the prefix cache serves them), and each response appends its
input items and output items to it."""

from __future__ import annotations

from typing import Any

from edge.errors import NotFoundError
from edge.state import current_state
from edge.store.conversations import ConversationStore
from edge.surfaces.responses.request import ParsedResponsesRequest, input_items
from edge.surfaces.responses.stored import numbered, replayable


async def history_of_conversation(conversation: str, owner: str) -> list[dict[str, Any]]:
    """The owner's conversation's items; a 404 naming ``conversation`` when there is none."""
    store = await current_state().store.conversations()
    if await store.get(conversation, owner) is None:
        raise NotFoundError(f"Conversation with id '{conversation}' not found.", param="conversation")
    return await store.items(conversation)


async def append_turn(
    store: ConversationStore, conversation: str, parsed: ParsedResponsesRequest, result: dict[str, Any]
) -> None:
    """Appends this turn's input items, then the response's output items, to ``conversation``."""
    await store.append(conversation, turn_items(parsed, result))


def turn_items(parsed: ParsedResponsesRequest, result: dict[str, Any]) -> list[dict[str, Any]]:
    """The items one turn appends to its conversation: its input items, then its output items."""
    return [*numbered(input_items(parsed.request)), *replayable(result["output"])]
