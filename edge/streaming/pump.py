"""One pump per streamed response: read the worker events, translate, frame, write; one clock.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from edge.deadlines import TimeLimits, deadline_error, idle_timeout_error
from edge.errors import GENERIC_INTERNAL_MESSAGE, EdgeError, InternalError
from edge.streaming import sse
from edge.streaming.connections import ChunkedBody, ClientTransport
from edge.workers.call_group import CallGroup
from sluice.coalesce import merge_into
from sluice.v1 import worker_pb2

log = logging.getLogger("sluice.edge")
stream_log = logging.getLogger("sluice.edge.stream")

# Events read since the last write after which a stream's reader waits for the writer. Merged
# deltas count once per event read, so this bounds both memory and the text of one write.
MAX_PENDING_EVENTS = 256
# Worker events that are model output (a choice's end included): the first write carrying one
# gives the time to first token, later ones the gaps.
_OUTPUT_KINDS = frozenset({"content", "reasoning", "refusal", "tool_call", "finished"})
# How early (a fraction of the write interval) output may go rather than wait for the interval.
_EARLY_FRACTION = 0.25

OnEvent = Callable[[int, worker_pb2.GenerateResponse], list[Any]]
Finish = Callable[[], list[Any]]


@dataclass(frozen=True)
class StreamFraming:
    """How one API surface puts its chunks on the wire.

    ``encode``: one chunk (whatever the surface's ``on_event`` returns) to its
    frame, e.g. ``data: <json>\\n\\n`` or ``event: <name>\\ndata: ...``;
    ``heartbeat``: the frame sent after ``heartbeat_s`` of silence;
    ``end``: what follows ``finish()``'s chunks on success (``data: [DONE]``,
    or nothing); ``error``: everything sent after a mid-stream failure (the
    error frame and whatever terminal frame the surface wants after it);
    ``surface``: the API's name in the stream metrics' ``surface`` label.
    """

    encode: Callable[[Any], bytes]
    heartbeat: bytes
    end: bytes
    error: Callable[[EdgeError], bytes]
    surface: str = "openai"


def _openai_error(error: EdgeError) -> bytes:
    return sse.error_frame(error.payload()) + sse.DONE_FRAME


#: OpenAI's chat and completions streams: ``data:`` chunks, ``event: error``, then ``data: [DONE]``.
OPENAI_FRAMING = StreamFraming(
    encode=sse.data_frame, heartbeat=sse.HEARTBEAT_FRAME, end=sse.DONE_FRAME, error=_openai_error
)


class StreamMetrics(Protocol):
    """What a pump reports (see :class:`edge.metrics.EdgeMetrics`)."""

    def stream_opened(self, surface: str) -> None: ...

    def stream_closed(self, surface: str, *, disconnected: bool) -> None: ...

    def first_output(self, surface: str, seconds: float) -> None: ...

    def output_gap(self, surface: str, seconds: float) -> None: ...

    def stream_error(self, surface: str, kind: str, code: str) -> None: ...


class StopRegistry(Protocol):
    """Where a pump registers to be stopped (the edge's drain state)."""

    def add(self, stoppable: Any) -> None: ...

    def discard(self, stoppable: Any) -> None: ...


@dataclass(frozen=True)
class PumpClock:
    """A stream's time settings: limits, heartbeat interval, write timeout, write interval
    (seconds; loop clock for ``deadline``)."""

    limits: TimeLimits
    deadline: float
    heartbeat_s: float
    write_timeout_s: float
    # Shortest gap between two writes that carry output (see :class:`StreamPump`); 0: none.
    write_interval_s: float = 0.0


class StreamPump:
    """The body of one streamed response (docs/edge-internals.md, "The stream pump"). Iterate it
    once (Quart does), then :meth:`aclose` it (Quart does, however the iteration ended)."""

    def __init__(
        self,
        group: CallGroup,
        on_event: OnEvent,
        finish: Finish,
        framing: StreamFraming,
        clock: PumpClock,
        *,
        metrics: StreamMetrics,
        drain: StopRegistry,
        request_id: str,
        started_at: float,
        transport: ClientTransport | None = None,
        body: ChunkedBody | None = None,
        on_close: Callable[[str], None] | None = None,
    ) -> None:
        self._on_close = on_close  # told how the stream ended (the request log's line)
        self._group = group
        self._on_event = on_event
        self._finish = finish
        self._framing = framing
        self._clock = clock
        self._metrics = metrics
        self._drain = drain
        self._request_id = request_id
        self._started_at = started_at
        self._transport = transport
        self._body = body  # used from the first write on, if the response's head allows it
        self._loop: asyncio.AbstractEventLoop | None = None
        # Read, not yet written: (call index, event), merged where the rules allow.
        self._pending: list[tuple[int, worker_pb2.GenerateResponse]] = []
        self._pending_reads = 0
        self._reader: asyncio.Task[None] | None = None
        self._reading = False  # the calls have not all ended
        self._waiting_for_space = False  # the reader waits for the writer, not for the workers
        self._space: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._failure: EdgeError | None = None  # a call failed
        self._stop_error: EdgeError | None = None  # a limit, or the shutdown
        self._heartbeat_due = False
        self._last_event = 0.0
        self._last_write = 0.0
        self._writing_since: float | None = None
        self._writer: asyncio.Task[Any] | None = None
        self._direct: bool | None = None  # writing straight to the connection; None: not yet known
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._hold: asyncio.TimerHandle | None = None  # ends a wait for the write interval
        self._last_output: float | None = None
        self._chunks = 0
        self._ended = False  # the last frame was handed out
        self._closed = False
        self._outcome = "client disconnected"

    # ------------------------------------------------------------- the body

    def __aiter__(self) -> StreamPump:
        return self

    async def __anext__(self) -> bytes:
        loop = self._loop
        if loop is None:
            loop = self._start()
        elif self._writing_since is not None:  # Quart asks again: the last write was taken
            self._writing_since = None
            self._last_write = loop.time()
        while True:
            if self._ended or self._closed:
                raise StopAsyncIteration
            out = b"" if self._held(loop) else self._take()
            if out:
                now = loop.time()
                self._last_write = now
                if self._direct is None:
                    self._direct = self._body is not None and self._body.usable()
                if not self._direct:
                    self._time_write(now)
                    return out
                if not await self._write_direct(out, now, loop):
                    raise StopAsyncIteration  # the client went away
                continue
            waiter = self._waiter = loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    async def _write_direct(self, out: bytes, now: float, loop: asyncio.AbstractEventLoop) -> bool:
        """Writes ``out`` as one chunk straight to the connection and waits while the client
        lets the buffer fill (timed like any write); False when the connection is gone."""
        body = self._body
        assert body is not None
        if body.closing():
            self._cancel_calls()
            return False
        body.write(out)
        if not body.needs_drain():
            return True
        self._time_write(now)
        try:
            await body.drain()
        except (ConnectionError, RuntimeError):
            self._cancel_calls()
            return False
        finally:
            self._writing_since = None
        self._last_write = loop.time()
        return True

    def _time_write(self, now: float) -> None:
        """A write is in progress from ``now``: the timer fires at the write timeout at the latest."""
        self._writing_since = now
        if now + self._clock.write_timeout_s < self._timer_at:
            self._arm(now)

    async def aclose(self) -> None:
        """Ends the stream: cancels every worker call (a no-op once they ended), stops the timer
        and the reader, settles the metrics. Idempotent; Quart calls it however the body ended."""
        if self._closed:
            return
        self._closed = True
        self._shutdown()
        if self._on_close is not None:
            self._on_close(self._outcome if self._ended else "client disconnected")
        if self._loop is None:
            return  # never started: nothing was counted
        if not self._ended:
            self._outcome = "client disconnected"
        self._metrics.stream_closed(self._framing.surface, disconnected=not self._ended)
        stream_log.info(
            "request %s: stream %s after %d data frames", self._request_id, self._outcome, self._chunks
        )

    def stop(self, error: EdgeError) -> None:
        """Ends the stream with ``error`` (a limit, or the shutdown's grace period): the calls are
        cancelled now; what was read goes out, then the error frame. The first call wins; a
        stream whose calls all ended already finishes normally."""
        if self._stop_error is not None or self._failure is not None or self._closed:
            return
        if self._loop is not None and not self._reading:
            return
        self._stop_error = error
        self._cancel_calls()
        self._wake()

    # ------------------------------------------------------------- internals

    def _start(self) -> asyncio.AbstractEventLoop:
        loop = self._loop = asyncio.get_running_loop()
        now = loop.time()
        self._last_event = self._last_write = now
        self._writer = asyncio.current_task()
        self._reading = True
        self._reader = loop.create_task(self._read())
        self._group.take_inline(self._has_space, self._push_now, self._read_failed)
        self._metrics.stream_opened(self._framing.surface)
        self._drain.add(self)
        self._arm(now)
        return loop

    async def _read(self) -> None:
        """The reader: the call group's events into the pending list until every call ended."""
        loop = self._loop
        assert loop is not None
        try:
            async with contextlib.aclosing(self._group.events()) as events:
                async for index, event in events:
                    self._push(index, event, loop)
                    if self._pending_reads >= MAX_PENDING_EVENTS:
                        await self._wait_for_space(loop)
        except EdgeError as error:
            self._fail(error)
            return
        except asyncio.CancelledError:
            raise
        except Exception as error:  # a bug of ours or a transport surprise: never a hang
            self._read_failed(error)
            return
        self._reading = False
        self._wake()

    # The reader's work for an event taken as it arrives (CallGroup.take_inline), its task asleep.

    def _has_space(self) -> bool:
        return self._pending_reads < MAX_PENDING_EVENTS

    def _push_now(self, index: int, event: worker_pb2.GenerateResponse) -> None:
        assert self._loop is not None
        self._push(index, event, self._loop)

    def _read_failed(self, error: Exception) -> None:
        log.error("request %s: reading a worker call failed", self._request_id, exc_info=error)
        self._fail(InternalError(GENERIC_INTERNAL_MESSAGE), logged=True)

    def _push(self, index: int, event: worker_pb2.GenerateResponse, loop: asyncio.AbstractEventLoop) -> None:
        self._last_event = loop.time()
        self._pending_reads += 1
        pending = self._pending
        if pending:
            last_index, last = pending[-1]
            if last_index == index and merge_into(last, event):
                return  # the writer was woken by the first one
        pending.append((index, event))
        if self._hold is None:  # a writer waiting for the write interval takes it then
            self._wake()

    async def _wait_for_space(self, loop: asyncio.AbstractEventLoop) -> None:
        """Waits until the writer took the pending events; the wait is not worker idle time."""
        if self._space is None or self._space.done():
            self._space = loop.create_future()
        self._waiting_for_space = True
        try:
            await asyncio.shield(self._space)
        finally:
            self._waiting_for_space = False
            self._last_event = loop.time()

    def _fail(self, error: EdgeError, *, logged: bool = False) -> None:
        """A call failed (or our own code did): what was read goes out, then ``error``."""
        if self._failure is None and self._stop_error is None:
            self._failure = error
            if not logged:
                log.info("request %s: stream ended with %s (%s)", self._request_id, error.type, error.message)
        self._cancel_calls()
        self._wake()

    def _take(self) -> bytes:
        """Everything ready to write, as one piece (empty when nothing is)."""
        parts: list[bytes] = []
        encode = self._framing.encode
        output = False
        if self._pending:
            events, self._pending, self._pending_reads = self._pending, [], 0
            if self._space is not None and not self._space.done():
                self._space.set_result(None)
            try:
                for index, event in events:
                    chunks = self._on_event(index, event)
                    if chunks:
                        if event.WhichOneof("event") in _OUTPUT_KINDS:
                            output = True
                        parts.extend(encode(chunk) for chunk in chunks)
            except Exception:
                log.exception("request %s: translating an event failed", self._request_id)
                self._fail(InternalError(GENERIC_INTERNAL_MESSAGE), logged=True)
        chunks_written = len(parts)
        error = self._failure or self._stop_error
        if not self._reading and error is None:
            try:
                finish = [encode(chunk) for chunk in self._finish()]
            except Exception:
                log.exception("request %s: finishing the stream failed", self._request_id)
                error = self._failure = InternalError(GENERIC_INTERNAL_MESSAGE)
            else:
                parts.extend(finish)
                chunks_written += len(finish)
                parts.append(self._framing.end)
                self._end("completed")
        if error is not None and not self._ended:
            parts.append(self._framing.error(error))
            self._metrics.stream_error(self._framing.surface, error.type, str(error.code or "unknown"))
            self._end(f"error {error.type}/{error.code}")
        if parts:
            self._heartbeat_due = False
            self._chunks += chunks_written
            if output:
                self._count_output()
            return b"".join(parts)
        if self._heartbeat_due:
            self._heartbeat_due = False
            return self._framing.heartbeat
        return b""

    def _held(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether the pending events wait for the write interval: the last write that carried
        output was less than three quarters of ``write_interval_s`` ago, so what arrives until
        the interval is over goes out with them, merged. The first output, the end of the stream
        and errors never wait."""
        urgent = not self._reading or self._failure is not None or self._stop_error is not None
        if self._hold is not None:
            if not urgent:
                return True
            self._hold.cancel()
            self._hold = None
            return False
        interval = self._clock.write_interval_s
        if urgent or not interval or self._last_output is None or not self._pending:
            return False
        due = self._last_output + interval
        # A wait shorter than a quarter of the interval is not worth a timer: a worker that paces
        # the call (GenerateRequest.stream_interval_ms) hands over at the step nearest each
        # window's end, so its deltas come about an interval apart, a little early as often as late.
        if loop.time() >= due - interval * _EARLY_FRACTION:
            return False
        self._hold = loop.call_at(due, self._end_hold)
        return True

    def _end_hold(self) -> None:
        self._hold = None
        self._wake()

    def _count_output(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        if self._last_output is None:
            # The request's start is on time.monotonic(); the loop's clock reads the same clock
            # (asyncio's exactly, uvloop's to the millisecond, hence the max).
            self._metrics.first_output(self._framing.surface, max(0.0, now - self._started_at))
        else:
            self._metrics.output_gap(self._framing.surface, now - self._last_output)
        self._last_output = now

    def _end(self, outcome: str) -> None:
        self._ended = True
        self._outcome = outcome
        self._cancel_calls()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _cancel_calls(self) -> None:
        self._group.cancel()
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()

    def _shutdown(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None
        self._cancel_calls()
        self._drain.discard(self)

    # ------------------------------------------------------------- the clock

    def _arm(self, now: float) -> None:
        """(Re)schedules the one timer for the earliest moment something may be due."""
        clock = self._clock
        due = clock.deadline
        if self._reading and not self._waiting_for_space:
            due = min(due, self._last_event + clock.limits.idle_s)
        if self._writing_since is not None:
            due = min(due, self._writing_since + clock.write_timeout_s)
        else:
            due = min(due, self._last_write + clock.heartbeat_s)
        if self._timer is not None:
            self._timer.cancel()
        assert self._loop is not None
        self._timer_at = max(due, now)
        self._timer = self._loop.call_at(self._timer_at, self._on_timer)

    def _on_timer(self) -> None:
        assert self._loop is not None
        self._timer = None
        if self._closed:
            return
        now = self._loop.time()
        clock = self._clock
        if self._writing_since is not None and now >= self._writing_since + clock.write_timeout_s:
            self._on_stalled_write()
            return
        if self._reading and not self._ended:
            if now >= clock.deadline:
                self.stop(deadline_error(clock.limits))
            elif not self._waiting_for_space and now >= self._last_event + clock.limits.idle_s:
                self.stop(idle_timeout_error(clock.limits))
        if self._writing_since is None and now >= self._last_write + clock.heartbeat_s and not self._ended:
            self._heartbeat_due = True
            self._last_write = now
            self._wake()
        self._arm(now)

    def _on_stalled_write(self) -> None:
        """The client took nothing for the write timeout: close its connection, end the calls."""
        log.warning(
            "client of request %s accepted no response bytes for %.1f s; closing the connection",
            self._request_id,
            self._clock.write_timeout_s,
        )
        self._cancel_calls()
        if self._transport is not None:
            self._transport.abort()  # the blocked send returns; Quart then closes the body
        elif self._writer is not None:
            self._writer.cancel()
