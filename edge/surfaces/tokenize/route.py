"""``POST /tokenize`` and ``POST /detokenize``: validate, one unary worker call, vLLM's answer."""

from __future__ import annotations

from typing import Any

from quart import Blueprint
from quart.wrappers import Response

from edge.http import current_request_id, current_settings, json_response, read_json_body, worker_header
from edge.openapi import Unary, documented
from edge.surfaces.images import prepare_images
from edge.surfaces.tokenize.request import (
    DetokenizeRequest,
    TokenizeRequest,
    parse_detokenize_request,
    parse_tokenize_body,
    tokenize_proto,
)
from edge.surfaces.tokenize.response import DetokenizeResult, TokenizeResult
from edge.surfaces.tokens import detokenize, tokenize

blueprint = Blueprint("tokenize", __name__)


@blueprint.post("/tokenize")
@documented(Unary("Token ids of a prompt or a chat (vLLM's shape)", TokenizeRequest, TokenizeResult))
async def tokenize_route() -> Response:
    parsed, chat = parse_tokenize_body(await read_json_body(), current_settings().limits)
    if chat is not None:
        await prepare_images(chat)
    request = tokenize_proto(parsed, chat, current_request_id())
    reply = await tokenize(request)
    body: dict[str, Any] = {
        "count": reply.count,
        "max_model_len": reply.max_model_len,
        "tokens": list(reply.ids),
    }
    if request.return_token_strs:
        body["token_strs"] = list(reply.token_strs)
    return json_response(body, headers=worker_header([reply.worker_id] if reply.worker_id else []))


@blueprint.post("/detokenize")
@documented(Unary("The text of token ids (vLLM's shape)", DetokenizeRequest, DetokenizeResult))
async def detokenize_route() -> Response:
    reply = await detokenize(parse_detokenize_request(await read_json_body()))
    return json_response(
        {"prompt": reply.text}, headers=worker_header([reply.worker_id] if reply.worker_id else [])
    )
