"""``/v1/responses``: the OpenAI Responses API rewritten as a chat request
(:mod:`edge.surfaces.responses.request`), named stream events and no ``[DONE]``; stored responses
read, listed, deleted and cancelled by the API key that made them."""

from __future__ import annotations

import time
from typing import Any

from quart import Blueprint, request
from quart.wrappers import Response

from edge.auth import caller_key_id
from edge.errors import InvalidRequestError, NotFoundError
from edge.http import json_response, read_json_body
from edge.openapi import NamedEventGeneration, Read, documented
from edge.requests.validation import bad
from edge.state import current_state
from edge.surfaces.answer import OnResult, generate_rewritten, named_events
from edge.surfaces.responses import background
from edge.surfaces.responses.events import event_stream
from edge.surfaces.responses.request import (
    ParsedResponsesRequest,
    ResponsesRequest,
    build_responses_request,
    conversation_id,
    validate_responses_request,
)
from edge.surfaces.responses.response import (
    InputItemList,
    ResponseDeleted,
    ResponseObject,
    ResponseStreamEvent,
)
from edge.surfaces.responses.stored import (
    current_store,
    ended,
    history_of,
    owned,
    record_of,
)
from edge.surfaces.responses.translate import ResponsesTranslator
from edge.surfaces.responses.turns import append_turn, history_of_conversation
from edge.surfaces.shared.ids import new_id
from edge.surfaces.shared.paging import PAGE_QUERY, item_page

blueprint = Blueprint("responses", __name__)
STREAM = (
    "one named event per typed Responses event (`event: response.output_text.delta`, "
    "data: a `ResponseStreamEvent` with its `sequence_number`), from `response.created` to "
    "`response.completed` (or `response.incomplete`); a failure after the stream began is an "
    "`error` event then `response.failed`; no `[DONE]`; `: heartbeat` comments keep it open."
)
FRAMING = named_events("responses")
_ID = {"response_id": "The response's id (`resp_...`)."}
_STATUSES = ("400", "401", "404")


@blueprint.post("/v1/responses")
@documented(
    NamedEventGeneration(
        "OpenAI Responses API: stored (`store`, default true), continued (`previous_response_id`), "
        "or run in the background (`background: true`, answered at once as `queued`, or with "
        "`stream: true` by its events, stored so that `GET` follows them again)",
        ResponsesRequest,
        ResponseObject,
        ResponseStreamEvent,
        STREAM,
    )
)
async def create_response() -> Response:
    body = await read_json_body()
    parsed_request = validate_responses_request(body)
    owner = caller_key_id()
    conversation = conversation_id(parsed_request)
    if conversation is not None:
        history = await history_of_conversation(conversation, owner)
    else:
        history = await history_of(parsed_request.previous_response_id, owner)
    parsed = build_responses_request(parsed_request, history)
    response_id, created = new_id("resp"), int(time.time())
    echo = parsed.echo()

    def translator(model: str) -> ResponsesTranslator:
        return ResponsesTranslator(response_id, created, model, echo)

    if parsed_request.background:
        queued = translator(parsed.chat.model).response("queued", output=[])
        await background.start(parsed, translator, queued, owner, history, body)
        if parsed.stream:
            return event_stream(response_id, owner, -1)
        return json_response(queued)
    return await generate_rewritten(parsed, translator, FRAMING, on_result=_saver(parsed, owner, history))


def _saver(parsed: ParsedResponsesRequest, owner: str, history: list[Any]) -> OnResult | None:
    """Stores a foreground response's result, and appends its turn to its conversation (None:
    neither). The store is taken here, in the request's context: a stream's result comes after
    its request's context has ended."""
    handle, conversation = current_state().store, conversation_id(parsed.request)
    if not parsed.stored and conversation is None:
        return None

    async def save(result: dict[str, Any]) -> None:
        if parsed.stored:
            await (await handle.get()).put(record_of(parsed, result, owner, history))
        if conversation is not None:
            await append_turn(await handle.conversations(), conversation, parsed, result)

    return save


@blueprint.get("/v1/responses/<response_id>")
@documented(
    Read(
        "A stored response (a background one: poll it until its status is final)",
        ResponseObject,
        "The Response as it is now.",
        _STATUSES,
        path_parameters=_ID,
        query_parameters={
            "stream": "`true`: the events of a background response created with `stream: true`, "
            "from its first (or after `starting_after`) until its end.",
            "starting_after": "With `stream`: the sequence number after which the events start.",
        },
    )
)
async def retrieve_response(response_id: str) -> Response:
    record = await owned(response_id, caller_key_id())
    if not _flag(request.args.get("stream"), "stream"):
        return json_response(record.response)
    if not (record.background and record.request.get("stream")):
        raise InvalidRequestError(
            "Only a background response created with stream=true can be streamed: read it instead.",
            param="stream",
            code="unsupported_parameter",
        )
    return event_stream(response_id, record.owner, _starting_after(request.args.get("starting_after")))


def _flag(value: str | None, name: str) -> bool:
    """A boolean query parameter (absent: false); a 400 naming it otherwise."""
    if value is None or value.lower() in ("false", "0"):
        return False
    if value.lower() in ("true", "1"):
        return True
    raise bad(name, f"must be true or false, got {value!r}")


def _starting_after(value: str | None) -> int:
    """``starting_after``: a sequence number, at least 0 (absent: -1, every event)."""
    if value is None:
        return -1
    try:
        number = int(value)
    except ValueError:
        raise bad("starting_after", f"must be an integer, got {value!r}") from None
    if not 0 <= number <= 2**31:
        raise bad("starting_after", f"must be in 0..{2**31}, got {number}")
    return number


@blueprint.delete("/v1/responses/<response_id>")
@documented(
    Read(
        "Deletes a stored response (a running background one stops)",
        ResponseDeleted,
        "It was deleted.",
        _STATUSES,
        path_parameters=_ID,
    )
)
async def delete_response(response_id: str) -> Response:
    if not await (await current_store()).delete(response_id, caller_key_id()):
        raise NotFoundError(f"No response found with id '{response_id}'.", param="response_id")
    current_state().background.cancel(response_id)
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})


@blueprint.post("/v1/responses/<response_id>/cancel")
@documented(
    Read(
        "Cancels a background response (one already ended is answered as it is)",
        ResponseObject,
        "The Response, `status: cancelled` unless it had ended.",
        _STATUSES,
        path_parameters=_ID,
    )
)
async def cancel_response(response_id: str) -> Response:
    owner = caller_key_id()
    record = await owned(response_id, owner)
    if not record.background:
        raise InvalidRequestError(
            "Only responses created with background=true can be cancelled.", param="response_id"
        )
    cancelled = ended(record.response, "cancelled")
    if await (await current_store()).cancel(response_id, owner, cancelled):
        current_state().background.cancel(response_id)  # elsewhere: its edge sees it at its renewal
        return json_response(cancelled)
    return json_response((await owned(response_id, owner)).response)


@blueprint.get("/v1/responses/<response_id>/input_items")
@documented(
    Read(
        "The input items of a stored response (this turn's), a page at a time",
        InputItemList,
        "A page of items.",
        _STATUSES,
        path_parameters=_ID,
        query_parameters=PAGE_QUERY,
    )
)
async def list_input_items(response_id: str) -> Response:
    items = (await owned(response_id, caller_key_id())).input_items
    return json_response(
        item_page(items, request.args.get("limit"), request.args.get("order"), request.args.get("after"))
    )
