"""``POST /v1/responses``: the OpenAI Responses API, stateless, rewritten as a chat request
(:mod:`edge.surfaces.responses.request`); named stream events and no ``[DONE]``."""

from __future__ import annotations

import time

from quart import Blueprint
from quart.wrappers import Response

from edge.http import current_request_id, read_json_body
from edge.surfaces.answer import generate, named_events
from edge.surfaces.responses.request import parse_responses_request
from edge.surfaces.responses.translate import ResponsesTranslator
from edge.surfaces.shared.ids import new_id
from edge.surfaces.shared.worker_request import call_metadata, to_generate_request

blueprint = Blueprint("responses", __name__)
FRAMING = named_events("responses")


@blueprint.post("/v1/responses")
async def create_response() -> Response:
    request_id = current_request_id()
    parsed = parse_responses_request(await read_json_body())
    return await generate(
        [to_generate_request(parsed.chat, request_id)],
        lambda model: ResponsesTranslator(
            response_id=new_id("resp"), created_at=int(time.time()), model=model, echo=parsed.echo()
        ),
        model=parsed.chat.model,
        stream=parsed.stream,
        framing=FRAMING,
        metadata=call_metadata(parsed.chat, request_id),
    )
