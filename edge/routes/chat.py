"""``POST /v1/chat/completions``: validate, open the worker call, answer JSON or SSE.

The call order and the cancellation rules are those of :mod:`edge.routes.generation`.
"""

from __future__ import annotations

import time

from quart import Blueprint
from quart.wrappers import Response

from edge import translate
from edge.openai_types import parse_chat_request
from edge.routes.common import current_request_id, current_settings, json_response, read_json_body
from edge.routes.generation import collect, open_calls, response_headers, sse_response

blueprint = Blueprint("chat", __name__)


@blueprint.post("/v1/chat/completions")
async def chat_completions() -> Response:
    request_id = current_request_id()
    chat = parse_chat_request(await read_json_body(), current_settings().limits)
    group = await open_calls([translate.to_generate_request(chat, request_id)])
    try:
        model = group.started(0).model or chat.model
        completion_id, created = translate.new_completion_id(), int(time.time())
        headers = response_headers(group)
        if not chat.stream:
            accumulator = translate.CompletionAccumulator(
                completion_id, created, model, logprobs=bool(chat.logprobs)
            )
            await collect(group, lambda _call, event: accumulator.add(event))
            return json_response(accumulator.result(), headers=headers)
        builder = translate.ChunkBuilder(
            completion_id,
            created,
            model,
            include_usage=chat.include_usage,
            continuous_usage=chat.continuous_usage,
            logprobs=bool(chat.logprobs),
        )
        return sse_response(group, lambda _call, event: builder.on_event(event), builder.finish, headers)
    except BaseException:
        # Failure, or cancellation while collecting a non-streamed answer: end the call now.
        group.cancel()
        raise
