"""``POST /v1/messages``: Anthropic Messages, rewritten as a chat request
(:mod:`edge.surfaces.anthropic.request`); errors in Anthropic's shape, ``event: ping`` heartbeats."""

from __future__ import annotations

from quart import Blueprint
from quart.wrappers import Response

from edge.http import current_request_id, read_json_body
from edge.streaming import sse
from edge.surfaces.answer import generate, named_events
from edge.surfaces.anthropic.request import parse_messages_request
from edge.surfaces.anthropic.translate import MessagesTranslator
from edge.surfaces.shared.ids import new_id
from edge.surfaces.shared.worker_request import call_metadata, to_generate_request

blueprint = Blueprint("messages", __name__)
FRAMING = named_events("anthropic", sse.ANTHROPIC_PING_FRAME)


@blueprint.post("/v1/messages")
async def create_message() -> Response:
    request_id = current_request_id()
    parsed = parse_messages_request(await read_json_body())
    worker_request = to_generate_request(parsed.chat, request_id)
    if parsed.request.top_k is not None:
        worker_request.sampling.top_k = parsed.request.top_k
    return await generate(
        [worker_request],
        lambda model: MessagesTranslator(new_id("msg"), model),
        model=parsed.chat.model,
        stream=parsed.stream,
        framing=FRAMING,
        metadata=call_metadata(parsed.chat, request_id),
    )
