"""``POST /v1/chat/completions``: validate, open the worker call, answer JSON or SSE.

Call order, and why:

1. parse and validate the body fully (a malformed request never opens a call);
2. open ``Generate`` on a worker and await its FIRST event: a failure before
   ``started`` (bad argument, unknown model, full queue, no worker) is still a
   plain JSON error with its own HTTP status, never a stream;
3. after ``started``: a streaming request gets its headers at once and then
   the chunks (DESIGN.md section 3); a non-streaming one gets one
   ``chat.completion``.

A client disconnect reaches us as cancellation (handler task cancelled) or
as ``aclose()`` of the response generator; both cancel the gRPC call at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from quart import Blueprint
from quart.wrappers import Response

from edge import sse, translate
from edge.errors import EdgeError, stream_error_payload
from edge.openai_types import parse_chat_request
from edge.routes.common import (
    current_pool,
    current_request_id,
    current_settings,
    json_response,
    read_json_body,
)
from edge.worker_pool import GenerateStream

log = logging.getLogger("sluice.edge")
blueprint = Blueprint("chat", __name__)


@blueprint.post("/v1/chat/completions")
async def chat_completions() -> Response:
    settings = current_settings()
    request_id = current_request_id()
    chat = parse_chat_request(await read_json_body())
    stream = await current_pool().generate(
        translate.to_generate_request(chat, request_id),
        request_id,
        settings.request_timeout_s,
        translate.call_metadata(chat, request_id),
    )
    try:
        started = stream.first.started
        model = started.model or chat.model
        completion_id = translate.new_completion_id()
        created = int(time.time())
        headers = {"X-Request-ID": request_id}
        if started.worker_id:
            headers["X-Sluice-Worker-ID"] = started.worker_id
        if not chat.stream:
            accumulator = translate.CompletionAccumulator(
                completion_id, created, model, logprobs=bool(chat.logprobs)
            )
            async for event in stream:
                accumulator.add(event)
            return json_response(accumulator.result(), headers=headers)
        builder = translate.ChunkBuilder(
            completion_id, created, model, include_usage=chat.include_usage, logprobs=bool(chat.logprobs)
        )
        body = sse.with_heartbeats(_sse_frames(stream, builder, request_id), settings.heartbeat_interval_s)
        headers["Cache-Control"] = "no-cache"
        # Tells nginx-style proxies not to buffer the stream.
        headers["X-Accel-Buffering"] = "no"
        response = Response(body, status=200, headers=headers, content_type="text/event-stream")
        # A stream lasts as long as generation does; Quart's default would cut it at 60 s.
        response.timeout = None
        return response
    except BaseException:
        # Failure, or cancellation while collecting a non-streamed answer: end the call now.
        stream.cancel()
        raise


async def _sse_frames(
    stream: GenerateStream, builder: translate.ChunkBuilder, request_id: str
) -> AsyncIterator[bytes]:
    """The SSE body after ``started``: chunks, an ``event: error`` on failure, then ``[DONE]``.

    The ``finally`` cancels the call however this generator ends: normally
    (a no-op), cancelled inside a read, or closed at a ``yield``.
    """
    try:
        async for event in stream:
            for chunk in builder.on_event(event):
                yield sse.data_frame(chunk)
    except EdgeError as error:
        log.info("request %s: stream ended with %s (%s)", request_id, error.type, error.message)
        yield sse.error_frame(error.payload())
    except Exception as error:
        log.exception("request %s: stream failed", request_id)
        yield sse.error_frame(stream_error_payload(error))
    finally:
        stream.cancel()
    yield sse.DONE_FRAME
