"""``POST /v1/responses``: the OpenAI Responses API, stateless; JSON or typed SSE events.

The request is rewritten as a chat request (:mod:`edge.responses_types`) and
answered from the worker's events by :mod:`edge.translate_responses`. The call
order, time limits and cancellation rules are those of
:mod:`edge.routes.generation`; the stream's events are named (``event:
response.output_text.delta``) and it ends without ``[DONE]``.
"""

from __future__ import annotations

import time

from quart import Blueprint
from quart.wrappers import Response

from edge import translate
from edge.responses_types import parse_responses_request
from edge.routes.common import current_request_id, read_json_body
from edge.routes.generation import open_calls, response_headers
from edge.routes.surfaces import answer_json, answer_stream
from edge.translate_responses import ResponsesTranslator, new_id

blueprint = Blueprint("responses", __name__)


@blueprint.post("/v1/responses")
async def create_response() -> Response:
    request_id = current_request_id()
    parsed = parse_responses_request(await read_json_body())
    group = await open_calls(
        [translate.to_generate_request(parsed.chat, request_id)],
        translate.call_metadata(parsed.chat, request_id),
    )
    try:
        translator = ResponsesTranslator(
            response_id=new_id("resp"),
            created_at=int(time.time()),
            model=group.started(0).model or parsed.chat.model,
            echo=parsed.echo(),
        )
        headers = response_headers(group)
        if not parsed.stream:
            return await answer_json(group, translator, headers)
        return answer_stream(group, translator, headers, "responses")
    except BaseException:
        group.cancel()
        raise
