"""``POST /v1/messages``: Anthropic Messages; JSON or Anthropic's SSE events.

The request is rewritten as a chat request (:mod:`edge.anthropic_types`) and
answered from the worker's events by :mod:`edge.translate_anthropic`. Every
error, before or during the stream, is in Anthropic's shape
(:mod:`edge.surface_errors`); idle streams get ``event: ping``. The call order,
time limits and cancellation rules are those of :mod:`edge.routes.generation`.
"""

from __future__ import annotations

from quart import Blueprint
from quart.wrappers import Response

from edge import sse, translate
from edge.anthropic_types import parse_messages_request
from edge.routes.common import current_request_id, read_json_body
from edge.routes.generation import open_calls, response_headers
from edge.routes.surfaces import answer_json, answer_stream
from edge.translate_anthropic import MessagesTranslator, new_id

blueprint = Blueprint("messages", __name__)


@blueprint.post("/v1/messages")
async def create_message() -> Response:
    request_id = current_request_id()
    parsed = parse_messages_request(await read_json_body())
    worker_request = translate.to_generate_request(parsed.chat, request_id)
    if parsed.request.top_k is not None:
        worker_request.sampling.top_k = parsed.request.top_k
    group = await open_calls([worker_request], translate.call_metadata(parsed.chat, request_id))
    try:
        translator = MessagesTranslator(new_id("msg"), group.started(0).model or parsed.chat.model)
        headers = response_headers(group)
        if not parsed.stream:
            return await answer_json(group, translator, headers)
        return answer_stream(group, translator, headers, "anthropic", sse.ANTHROPIC_PING_FRAME)
    except BaseException:
        group.cancel()
        raise
