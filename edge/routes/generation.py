"""What the generation routes (chat and text completions) share.

Call order, and why:

1. the route parses and validates the body fully (a malformed request never
   opens a call);
2. :func:`open_calls` opens the worker call(s) and awaits each FIRST event:
   a failure before ``started`` (bad argument, unknown model, full queue, no
   worker) is still a plain JSON error with its own HTTP status, never a
   stream;
3. after ``started``: :func:`sse_response` sends the headers at once and then
   the chunks (DESIGN.md section 3); :func:`collect` feeds every event to an
   accumulator for a non-streaming answer.

A client disconnect reaches us as cancellation (handler task cancelled) or as
``aclose()`` of the response generator; both cancel every worker call at once.
A route must call ``group.cancel()`` if it fails between steps 2 and 3.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from quart.wrappers import Response

from edge import sse
from edge.call_group import CallGroup
from edge.errors import EdgeError, stream_error_payload
from edge.routes.common import current_pool, current_request_id, current_settings, worker_header
from sluice.v1 import worker_pb2

log = logging.getLogger("sluice.edge")

OnEvent = Callable[[int, worker_pb2.GenerateResponse], list[dict[str, Any]]]
Finish = Callable[[], list[dict[str, Any]]]


async def open_calls(
    requests: Sequence[worker_pb2.GenerateRequest], metadata: Sequence[tuple[str, str | bytes]] = ()
) -> CallGroup:
    """Opens one worker call per request with the edge's deadline; raises :class:`EdgeError`."""
    settings = current_settings()
    return await CallGroup.open(
        current_pool(), requests, current_request_id(), settings.request_timeout_s, metadata
    )


def response_headers(group: CallGroup) -> dict[str, str]:
    """``X-Request-ID`` and ``X-Sluice-Worker-ID`` for a committed response."""
    return {"X-Request-ID": current_request_id(), **worker_header(group.worker_ids)}


async def collect(group: CallGroup, add: Callable[[int, worker_pb2.GenerateResponse], None]) -> None:
    """Feeds every event of every call to ``add``; raises :class:`EdgeError` if a call fails."""
    async for call, event in group.events():
        add(call, event)


def sse_response(group: CallGroup, on_event: OnEvent, finish: Finish, headers: dict[str, str]) -> Response:
    """The 200 ``text/event-stream`` response: ``on_event``'s chunks for every event, then
    ``finish()``'s, then ``data: [DONE]``; heartbeats while the workers are silent."""
    settings = current_settings()
    body = sse.with_heartbeats(
        _frames(group, on_event, finish, current_request_id()), settings.heartbeat_interval_s
    )
    headers = {
        **headers,
        "Cache-Control": "no-cache",
        # Tells nginx-style proxies not to buffer the stream.
        "X-Accel-Buffering": "no",
    }
    response = Response(body, status=200, headers=headers, content_type="text/event-stream")
    # A stream lasts as long as generation does; Quart's default would cut it at 60 s.
    response.timeout = None
    return response


async def _frames(
    group: CallGroup, on_event: OnEvent, finish: Finish, request_id: str
) -> AsyncIterator[bytes]:
    """The SSE body after ``started``: chunks, an ``event: error`` on failure, then ``[DONE]``.

    The ``finally`` cancels the calls however this generator ends: normally
    (a no-op), cancelled inside a read, or closed at a ``yield``.
    """
    try:
        async for call, event in group.events():
            for chunk in on_event(call, event):
                yield sse.data_frame(chunk)
        for chunk in finish():
            yield sse.data_frame(chunk)
    except EdgeError as error:
        log.info("request %s: stream ended with %s (%s)", request_id, error.type, error.message)
        yield sse.error_frame(error.payload())
    except Exception as error:
        log.exception("request %s: stream failed", request_id)
        yield sse.error_frame(stream_error_payload(error))
    finally:
        group.cancel()
    yield sse.DONE_FRAME
