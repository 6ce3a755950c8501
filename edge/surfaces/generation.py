"""Opening a response's worker calls, and the two ways of answering from them: :func:`collect`
(one JSON body) and :func:`sse_response` (a stream, pumped by :class:`~edge.streaming.pump.StreamPump`).

The call order, time limits and cancellation rules are in docs/edge-internals.md,
"Call order of a generation request".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from quart import request
from quart.wrappers import Response

from edge.auth import caller_tenant
from edge.deadlines import IDLE_TIMEOUT_HEADER, TIMEOUT_HEADER, EventGuard, request_limits
from edge.drain import shutting_down_error
from edge.http import current_request_id, worker_header
from edge.rate_limits import request_meter
from edge.requests.validation import bad
from edge.state import EdgeState, RequestState, current_request, current_state
from edge.streaming.connections import scope_chunked_body, scope_transport
from edge.streaming.pump import Finish, OnEvent, PumpClock, StreamFraming, StreamPump
from edge.tracing import current_trace
from edge.workers.call_group import CallGroup
from edge.workers.migration import MigrationPolicy, resumable_request
from sluice.limits import MAX_STREAM_INTERVAL_MS
from sluice.v1 import worker_pb2

log = logging.getLogger("sluice.edge")
# How much later than the request's own deadline its gRPC calls' deadline falls.
GRPC_DEADLINE_MARGIN_S = 1.0


async def open_calls(
    requests: Sequence[worker_pb2.GenerateRequest],
    metadata: Sequence[tuple[str, str | bytes]] = (),
    *,
    load_events: bool = False,
) -> CallGroup:
    """Opens one worker call per request with the request's total deadline; raises
    :class:`~edge.errors.EdgeError` (a 503 while the edge drains, a 400 for a bad timeout header).

    While no worker serves but one is loading its model, each call waits for the load up to
    ``--wait-for-load-seconds`` (``model_load_wait_seconds``): silently, so a load that does not
    end in time is the same 503 as before; with ``load_events`` the first event may instead be a
    MODEL_LOAD progress event, which commits the response so that the caller can show the load.

    The calls ask for ``progress`` events, so a request waiting in a worker's
    queue or in a long prefill still resets the idle timeout. The request id
    travels in each request's ``request_id`` field (set by the translator);
    ``metadata`` is extra call metadata, if any.
    """
    state = current_state()
    if state.drain.draining:
        error = shutting_down_error()
        # Make a keep-alive client reconnect, so its retry can reach another replica.
        error.extra_headers["Connection"] = "close"
        raise error
    await check_choices(requests)
    limits = request_limits(
        request.headers.get(TIMEOUT_HEADER), request.headers.get(IDLE_TIMEOUT_HEADER), state.settings
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.total_s
    migration = MigrationPolicy(
        state.settings.max_stream_migrations if state.settings.migrate_streams else 0, state.metrics
    )
    tenant = caller_tenant()
    meter = request_meter()
    # What arrives within a stream's write interval is merged anyway (edge.streaming.pump): the
    # worker keeps it back instead, so one delta per interval crosses, not one per token.
    interval_ms = min(MAX_STREAM_INTERVAL_MS, round(state.settings.stream_write_interval_s * 1000))
    for worker_request in requests:
        worker_request.tenant = tenant  # the API key's, whatever the body said
        worker_request.stream_progress = True
        worker_request.model_load_wait_seconds = state.settings.wait_for_load_s
        worker_request.stream_interval_ms = interval_ms
        if (migration.enabled and resumable_request(worker_request)) or meter is not None:
            # What a call that moves to another worker resumes from (edge.workers.migration), and
            # what a key's tokens per minute count as they stream (edge.rate_limits).
            worker_request.return_token_ids = True
    # The edge's own timer is authoritative (one clear error, from one clock); the gRPC
    # deadline, a little later, is the backstop that also tells the worker when to give up.
    guard = EventGuard(limits, loop)
    try:
        async with asyncio.timeout_at(deadline) as timer:
            group = await CallGroup.open(
                state.pool,
                requests,
                current_request_id(),
                limits.total_s + GRPC_DEADLINE_MARGIN_S,
                metadata,
                migration=migration,
                load_events=load_events,
            )
    except TimeoutError:
        if timer.expired():
            raise guard.deadline_error() from None
        raise
    group.limits, group.deadline = limits, deadline
    if meter is not None:
        group.observer = meter.observe
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        # The client went away just as the first event arrived, and the cancellation was
        # swallowed on the way (Python 3.11's asyncio.wait_for returns a result that races
        # with a cancellation): honour it here, or the calls would run to their end.
        group.cancel()
        raise asyncio.CancelledError
    return group


async def check_choices(requests: Sequence[worker_pb2.GenerateRequest]) -> None:
    """A 400 naming ``n`` when it asks for more choices than any worker of the model serves (their
    ListModels ``max_n``: the contract's bound and their ``--max-running``), before any call opens."""
    n = max((r.sampling.n for r in requests if r.sampling.HasField("n")), default=1)
    if n <= 1:
        return
    model = requests[0].model
    most = await current_state().pool.most_choices(model)
    if most is not None and n > most:
        raise bad(
            "n",
            f"must be at most {most}, the most choices the workers of the model {model!r} serve "
            f"(their --max-running), got {n}",
        )


def response_headers(group: CallGroup) -> dict[str, str]:
    """``X-Request-ID`` and ``X-Sluice-Worker-ID`` for a committed response."""
    return {"X-Request-ID": current_request_id(), **worker_header(group.worker_ids)}


async def collect(group: CallGroup, add: Callable[[int, worker_pb2.GenerateResponse], None]) -> None:
    """Feeds every event of every call to ``add``; raises :class:`~edge.errors.EdgeError` if a call
    fails or a time limit (or the shutdown grace period) ends the request."""
    guard = EventGuard(group.time_limits(), deadline=group.deadline)
    with current_state().drain.track(guard):
        async for call, event in guard.watch(group.events()):
            add(call, event)


def _stream_logged(state: EdgeState, request_state: RequestState | None) -> Callable[[str], None] | None:
    """With ``--log-requests``: writes the request's line when its stream ends; with
    ``--otlp-traces-endpoint``: ends the request's span then."""
    logger, trace = state.request_log, current_trace()
    record = request_state.log if request_state is not None else None
    if record is not None:
        record.stream = True
    if trace is not None:
        trace.streamed = True

    def closed(outcome: str) -> None:
        if logger is not None and record is not None:
            logger.write(record, outcome)
        if trace is not None:
            trace.end(outcome)

    return closed if trace is not None or (logger is not None and record is not None) else None


def sse_response(
    group: CallGroup,
    on_event: OnEvent,
    finish: Finish,
    headers: dict[str, str],
    *,
    framing: StreamFraming,
    content_type: str = "text/event-stream",
) -> Response:
    """The 200 streamed response: ``on_event``'s chunks for every event, then ``finish()``'s, then
    ``framing.end``; heartbeats while the workers are silent; ``framing.error`` after a failure.

    Everything the body needs is taken here, inside the request context: the
    body runs after the handler returned.
    """
    state = current_state()
    settings = state.settings
    request_state = current_request()
    limits = group.time_limits()
    clock = PumpClock(
        limits=limits,
        deadline=group.deadline if group.deadline is not None else time.monotonic() + limits.total_s,
        heartbeat_s=settings.heartbeat_interval_s,
        write_timeout_s=settings.write_timeout_s,
        write_interval_s=settings.stream_write_interval_s,
    )
    pump = StreamPump(
        group,
        on_event,
        finish,
        framing,
        clock,
        metrics=state.metrics,
        drain=state.drain,
        request_id=current_request_id(),
        started_at=request_state.started_at if request_state is not None else time.monotonic(),
        transport=scope_transport(request.scope),
        body=scope_chunked_body(request.scope),
        on_close=_stream_logged(state, request_state),
    )
    headers = {
        **headers,
        "Cache-Control": "no-cache",
        # Tells nginx-style proxies not to buffer the stream.
        "X-Accel-Buffering": "no",
    }
    response = Response(pump, status=200, headers=headers, content_type=content_type)
    # A stream lasts as long as generation does; Quart's default would cut it at 60 s.
    response.timeout = None
    return response
