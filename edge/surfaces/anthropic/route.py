"""``POST /v1/messages``: Anthropic Messages, rewritten as a chat request
(:mod:`edge.surfaces.anthropic.request`); errors in Anthropic's shape, ``event: ping`` heartbeats."""

from __future__ import annotations

from quart import Blueprint
from quart.wrappers import Response

from edge.http import read_json_body
from edge.streaming import sse
from edge.surfaces.answer import generate_rewritten, named_events
from edge.surfaces.anthropic.request import parse_messages_request
from edge.surfaces.anthropic.translate import MessagesTranslator
from edge.surfaces.shared.ids import new_id

blueprint = Blueprint("messages", __name__)
FRAMING = named_events("anthropic", sse.ANTHROPIC_PING_FRAME)


@blueprint.post("/v1/messages")
async def create_message() -> Response:
    parsed = parse_messages_request(await read_json_body())
    return await generate_rewritten(parsed, lambda model: MessagesTranslator(new_id("msg"), model), FRAMING)
