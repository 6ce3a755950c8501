"""``POST /v1/responses``: the OpenAI Responses API, stateless, rewritten as a chat request
(:mod:`edge.surfaces.responses.request`); named stream events and no ``[DONE]``."""

from __future__ import annotations

import time

from quart import Blueprint
from quart.wrappers import Response

from edge.http import read_json_body
from edge.openapi import NamedEventGeneration, documented
from edge.surfaces.answer import generate_rewritten, named_events
from edge.surfaces.responses.request import ResponsesRequest, parse_responses_request
from edge.surfaces.responses.response import ResponseObject, ResponseStreamEvent
from edge.surfaces.responses.translate import ResponsesTranslator
from edge.surfaces.shared.ids import new_id

blueprint = Blueprint("responses", __name__)
STREAM = (
    "one named event per typed Responses event (`event: response.output_text.delta`, "
    "data: a `ResponseStreamEvent` with its `sequence_number`), from `response.created` to "
    "`response.completed` (or `response.incomplete`); a failure after the stream began is an "
    "`error` event then `response.failed`; no `[DONE]`; `: heartbeat` comments keep it open."
)
FRAMING = named_events("responses")


@blueprint.post("/v1/responses")
@documented(
    NamedEventGeneration(
        "OpenAI Responses API (stateless)", ResponsesRequest, ResponseObject, ResponseStreamEvent, STREAM
    )
)
async def create_response() -> Response:
    parsed = parse_responses_request(await read_json_body())
    echo = parsed.echo()
    return await generate_rewritten(
        parsed,
        lambda model: ResponsesTranslator(new_id("resp"), int(time.time()), model, echo),
        FRAMING,
    )
