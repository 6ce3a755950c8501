"""``POST /v1/messages``: Anthropic Messages, rewritten as a chat request
(:mod:`edge.surfaces.anthropic.request`); errors in Anthropic's shape, ``event: ping`` heartbeats.
``POST /v1/messages/count_tokens``: the same request's prompt tokens, counted by the worker."""

from __future__ import annotations

from quart import Blueprint
from quart.wrappers import Response

from edge.http import current_request_id, json_response, read_json_body, worker_header
from edge.openapi import BEARER_OR_KEY, NamedEventGeneration, Unary, documented
from edge.streaming import sse
from edge.surfaces.answer import generate_rewritten, named_events
from edge.surfaces.anthropic.request import CountTokensRequest, MessagesRequest, parse_messages_request
from edge.surfaces.anthropic.response import (
    AnthropicErrorResponse,
    AnthropicMessage,
    AnthropicStreamEvent,
    InputTokens,
)
from edge.surfaces.anthropic.translate import MessagesTranslator
from edge.surfaces.images import prepare_images
from edge.surfaces.shared.ids import new_id
from edge.surfaces.shared.worker_request import to_generate_request
from edge.surfaces.tokens import tokenize
from sluice.v1 import worker_pb2

blueprint = Blueprint("messages", __name__)
STREAM = (
    "Anthropic's events (`message_start`, `content_block_start`, `content_block_delta`, "
    "`content_block_stop`, `message_delta`, `message_stop`; data: `AnthropicStreamEvent`); a failure "
    "after the stream began is one `error` event (data: `AnthropicErrorResponse`); `ping` events keep "
    "an idle stream open."
)
FRAMING = named_events("anthropic", sse.ANTHROPIC_PING_FRAME)


@blueprint.post("/v1/messages")
@documented(
    NamedEventGeneration(
        "Anthropic Messages",
        MessagesRequest,
        AnthropicMessage,
        AnthropicStreamEvent,
        STREAM,
        AnthropicErrorResponse,
        BEARER_OR_KEY,
    )
)
async def create_message() -> Response:
    parsed = parse_messages_request(await read_json_body())
    return await generate_rewritten(parsed, lambda model: MessagesTranslator(new_id("msg"), model), FRAMING)


@blueprint.post("/v1/messages/count_tokens")
@documented(
    Unary(
        "Anthropic token counting: the prompt tokens of a Messages body",
        CountTokensRequest,
        InputTokens,
        AnthropicErrorResponse,
        BEARER_OR_KEY,
    )
)
async def count_tokens() -> Response:
    """The prompt a ``/v1/messages`` call with this body would start with (system, tools and
    tool blocks included), counted with the model's template: ``{"input_tokens": N}``."""
    parsed = parse_messages_request(await read_json_body(), CountTokensRequest)
    await prepare_images(parsed.chat)
    chat = to_generate_request(parsed.chat, current_request_id()).chat
    reply = await tokenize(worker_pb2.TokenizeRequest(model=parsed.chat.model, chat=chat))
    return json_response(
        {"input_tokens": reply.count}, headers=worker_header([reply.worker_id] if reply.worker_id else [])
    )
