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

Time limits (:mod:`edge.deadlines`): :func:`open_calls` reads the request's
limits (``X-Sluice-Timeout``, ``X-Sluice-Idle-Timeout``; a bad value is a
400 before any call opens), enforces the total deadline itself while the
calls open (their gRPC deadline, 1 s later, is only a backstop) and keeps an
:class:`~edge.deadlines.EventGuard` for the request; the guard ends
the events of :func:`sse_response` and :func:`collect` at the total deadline,
after the idle timeout, or when a draining edge's grace period ends
(:mod:`edge.drain`), cancelling the calls. While draining, :func:`open_calls`
refuses new requests with 503 ``server_shutting_down``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from quart import g, request
from quart.wrappers import Response

from edge import metrics, sse
from edge.call_group import CallGroup
from edge.deadlines import IDLE_TIMEOUT_HEADER, TIMEOUT_HEADER, EventGuard, request_limits
from edge.drain import Drain, current_drain, shutting_down_error
from edge.errors import GENERIC_INTERNAL_MESSAGE, EdgeError, InternalError, stream_error_payload
from edge.routes.common import current_pool, current_request_id, current_settings, worker_header
from sluice.v1 import worker_pb2

log = logging.getLogger("sluice.edge")
# How much later than the request's own deadline its gRPC calls' deadline falls.
GRPC_DEADLINE_MARGIN_S = 1.0

OnEvent = Callable[[int, worker_pb2.GenerateResponse], list[dict[str, Any]]]
Finish = Callable[[], list[dict[str, Any]]]
# A named-event surface's events for a failure after the stream began (Responses, Anthropic,
# native); without one, the OpenAI `event: error` frame is sent.
OnError = Callable[[EdgeError], list[dict[str, Any]]]


async def open_calls(
    requests: Sequence[worker_pb2.GenerateRequest], metadata: Sequence[tuple[str, str | bytes]] = ()
) -> CallGroup:
    """Opens one worker call per request with the request's total deadline; raises
    :class:`EdgeError` (a 503 while the edge drains, a 400 for a bad timeout header).

    The calls ask for ``progress`` events, so a request waiting in a worker's
    queue or in a long prefill still resets the idle timeout.
    """
    if current_drain().draining:
        error = shutting_down_error()
        # Make a keep-alive client reconnect, so its retry can reach another replica.
        error.extra_headers["Connection"] = "close"
        raise error
    settings = current_settings()
    limits = request_limits(
        request.headers.get(TIMEOUT_HEADER), request.headers.get(IDLE_TIMEOUT_HEADER), settings
    )
    guard = EventGuard(limits)
    g.sluice_event_guard = guard
    for worker_request in requests:
        worker_request.stream_progress = True
    # The edge's own timer is authoritative (one clear error, from one clock); the gRPC
    # deadline, a little later, is the backstop that also tells the worker when to give up.
    try:
        async with asyncio.timeout_at(guard.deadline) as timer:
            group = await CallGroup.open(
                current_pool(),
                requests,
                current_request_id(),
                limits.total_s + GRPC_DEADLINE_MARGIN_S,
                metadata,
            )
    except TimeoutError:
        if timer.expired():
            raise guard.deadline_error() from None
        raise
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        # The client went away just as the first event arrived, and the cancellation was
        # swallowed on the way (Python 3.11's asyncio.wait_for returns a result that races
        # with a cancellation): honour it here, or the calls would run to their end.
        group.cancel()
        raise asyncio.CancelledError
    return group


def _request_guard() -> EventGuard:
    """The guard :func:`open_calls` made for this request."""
    guard: EventGuard = g.sluice_event_guard
    return guard


def response_headers(group: CallGroup) -> dict[str, str]:
    """``X-Request-ID`` and ``X-Sluice-Worker-ID`` for a committed response."""
    return {"X-Request-ID": current_request_id(), **worker_header(group.worker_ids)}


async def collect(group: CallGroup, add: Callable[[int, worker_pb2.GenerateResponse], None]) -> None:
    """Feeds every event of every call to ``add``; raises :class:`EdgeError` if a call fails or
    a time limit (or the shutdown grace period) ends the request."""
    guard = _request_guard()
    with current_drain().track(guard):
        async for call, event in guard.watch(group.events()):
            add(call, event)


def sse_response(
    group: CallGroup,
    on_event: OnEvent,
    finish: Finish,
    headers: dict[str, str],
    framing: sse.Framing = sse.OPENAI_FRAMING,
    on_error: OnError | None = None,
) -> Response:
    """The 200 ``text/event-stream`` response: ``on_event``'s chunks for every event, then
    ``finish()``'s, then ``data: [DONE]``; heartbeats while the workers are silent.

    ``framing`` (default OpenAI's) decides how each chunk is written, the heartbeat
    frame and whether ``[DONE]`` ends the stream; ``on_error`` gives a named-event
    surface's own events for a failure (default: the OpenAI ``event: error`` frame).

    Everything the body needs is taken here, inside the request context: the
    body runs after the handler returned.
    """
    settings = current_settings()
    body = sse.with_heartbeats(
        _frames(
            group,
            _request_guard(),
            current_drain(),
            on_event,
            finish,
            current_request_id(),
            framing,
            on_error,
        ),
        settings.heartbeat_interval_s,
        framing.heartbeat,
    )
    # TTFT, chunk gaps, errors, disconnects (edge/metrics.py)
    body = metrics.observe_stream(body, framing=framing)
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
    group: CallGroup,
    guard: EventGuard,
    drain: Drain,
    on_event: OnEvent,
    finish: Finish,
    request_id: str,
    framing: sse.Framing = sse.OPENAI_FRAMING,
    on_error: OnError | None = None,
) -> AsyncIterator[bytes]:
    """The SSE body after ``started``: chunks, an ``event: error`` on failure (a worker error, a
    time limit, the end of the shutdown grace period), then ``[DONE]``.

    The ``finally`` cancels the calls however this generator ends: normally
    (a no-op), cancelled inside a read, or closed at a ``yield``.
    """
    try:
        with drain.track(guard):
            async for call, event in guard.watch(group.events()):
                for chunk in on_event(call, event):
                    yield framing.frame(chunk)
        for chunk in finish():
            yield framing.frame(chunk)
    except EdgeError as error:
        log.info("request %s: stream ended with %s (%s)", request_id, error.type, error.message)
        for frame in _error_frames(error, framing, on_error):
            yield frame
    except Exception:
        log.exception("request %s: stream failed", request_id)
        for frame in _error_frames(InternalError(GENERIC_INTERNAL_MESSAGE), framing, on_error):
            yield frame
    finally:
        group.cancel()
    if framing.done is not None:
        yield framing.done


def _error_frames(error: EdgeError, framing: sse.Framing, on_error: OnError | None) -> list[bytes]:
    """The frames that report ``error`` mid-stream: the surface's own events, else OpenAI's."""
    if on_error is None:
        return [sse.error_frame(stream_error_payload(error))]
    return [framing.frame(obj) for obj in on_error(error)]
