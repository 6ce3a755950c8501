"""``POST /v1/responses``: the OpenAI Responses API, stateless, rewritten as a chat request
(:mod:`edge.surfaces.responses.request`); named stream events and no ``[DONE]``."""

from __future__ import annotations

import time

from quart import Blueprint
from quart.wrappers import Response

from edge.http import read_json_body
from edge.surfaces.answer import generate_rewritten, named_events
from edge.surfaces.responses.request import parse_responses_request
from edge.surfaces.responses.translate import ResponsesTranslator
from edge.surfaces.shared.ids import new_id

blueprint = Blueprint("responses", __name__)
FRAMING = named_events("responses")


@blueprint.post("/v1/responses")
async def create_response() -> Response:
    parsed = parse_responses_request(await read_json_body())
    echo = parsed.echo()
    return await generate_rewritten(
        parsed,
        lambda model: ResponsesTranslator(new_id("resp"), int(time.time()), model, echo),
        FRAMING,
    )
