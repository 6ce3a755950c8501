"""``POST /v1/chat/completions``: validate, then answer on :func:`edge.surfaces.answer.generate`."""

from __future__ import annotations

from quart import Blueprint
from quart.wrappers import Response

from edge.http import current_request_id, current_settings, read_json_body
from edge.openapi import Generation, documented
from edge.surfaces.answer import generate_openai
from edge.surfaces.chat.response import ChatCompletion, ChatCompletionChunk
from edge.surfaces.chat.translate import ChatTranslator
from edge.surfaces.images import prepare_images
from edge.surfaces.shared.chat_request import ChatCompletionRequest, parse_chat_request
from edge.surfaces.shared.structured import naming_form
from edge.surfaces.shared.worker_request import to_generate_request

blueprint = Blueprint("chat", __name__)


@blueprint.post("/v1/chat/completions")
@documented(Generation("Chat completion", ChatCompletionRequest, ChatCompletion, ChatCompletionChunk))
async def chat_completions() -> Response:
    chat = parse_chat_request(await read_json_body(), current_settings().limits)
    await prepare_images(chat)
    requests = [to_generate_request(chat, current_request_id())]
    with naming_form(chat.structured()):
        return await generate_openai(requests, chat, ChatTranslator, "chatcmpl", logprobs=bool(chat.logprobs))
