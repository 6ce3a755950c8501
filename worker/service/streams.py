"""``GenerateStreams``: many requests on one bidirectional call, one message per engine step, with
credit per stream so that a slow reader's deltas merge while the other streams go on.

Design notes: docs/worker.md, "Multiplexed streams".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from sluice.coalesce import merge_into
from sluice.status import DETAILS_KEY
from sluice.v1 import worker_pb2 as pb
from worker.errors import InvalidRequest, WorkerError
from worker.service.wire_decoding import UndecodableRequest

log = logging.getLogger(__name__)

#: Messages a stream may be sent before its caller grants more (``OpenStream.window`` = 0).
DEFAULT_WINDOW = 4

Events = AsyncGenerator[pb.GenerateResponse, None]


async def relayed(events: Events, context: grpc.aio.ServicerContext) -> Events:
    """``events`` as one ``Generate`` call answers them: a :class:`WorkerError` ends the call with
    its status."""
    try:
        async for event in events:
            yield event
    except WorkerError as exc:
        await context.abort_with_status(exc.to_status())


#: One stream's events (``WorkerService.stream_events``): its open message, the seconds left
#: before its deadline (None: none) and the sink its generated events go to as each step delivers
#: them (the generator yields those before them); raises :class:`WorkerError` for the status that
#: ends it.
Sink = Callable[[pb.GenerateResponse], None]
OpenEvents = Callable[[pb.OpenStream, Callable[[], float | None], Sink], Events]


class ProtocolError(InvalidRequest):
    """The caller broke the call's rules (an id opened twice): the whole call ends."""


def stream_end(status: grpc.Status | None = None) -> pb.StreamEnd:
    """A stream's end: OK without ``status``, else the code, message and details bytes of the
    status ``Generate`` would have ended with."""
    if status is None:
        return pb.StreamEnd()
    details = b""
    for key, value in status.trailing_metadata or ():
        if key == DETAILS_KEY and isinstance(value, bytes):
            details = value
    return pb.StreamEnd(code=status.code.value[0], message=status.details or "", details=details)


def _plain_end(code: grpc.StatusCode, message: str) -> pb.StreamEnd:
    return pb.StreamEnd(code=code.value[0], message=message)


@dataclass(eq=False)
class _Entry:
    """What waits in the outbox for one stream: its events (merged where the rule allows), its end."""

    events: list[pb.GenerateResponse] = field(default_factory=list)
    end: pb.StreamEnd | None = None


@dataclass(eq=False)
class _Stream:
    """One open stream: its credit (messages it may still be sent) and its pump task."""

    id: int
    credit: int
    deadline: float | None  # time.monotonic()
    granted: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    cancelled: bool = False

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    async def wait_for_credit(self) -> None:
        while self.credit <= 0:
            self.granted.clear()
            await self.granted.wait()


class StreamsSession:
    """The state of one ``GenerateStreams`` call: its open streams, each with a task that waits for
    its end, and the outbox the writer empties into one message whenever it is woken.

    A step's events reach the outbox straight from the step's hand-over (no task wakes per stream
    per step); a stream without credit keeps its entry there, where its steps merge
    (``sluice/coalesce.py``'s rule) until the caller grants more."""

    def __init__(self, open_events: OpenEvents) -> None:
        self._open_events = open_events
        self._streams: dict[int, _Stream] = {}
        self._outbox: dict[int, _Entry] = {}
        self._wake = asyncio.Event()
        self._closed = False

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def receive(self, message: pb.StreamsRequest) -> None:
        """Applies one caller message: opens, then cancellations, then credit."""
        for opened in message.open:
            self._open(opened)
        for stream_id in message.cancel:
            self._cancel(stream_id)
        for stream_id in message.credit:
            stream = self._streams.get(stream_id)
            if stream is not None:  # else ended meanwhile
                stream.credit += 1
                stream.granted.set()
                if stream_id in self._outbox:
                    self._wake.set()

    def close(self) -> None:
        """The caller sends no more: the call ends once its open streams have."""
        self._closed = True
        self._wake.set()

    async def cancel_all(self) -> None:
        """Drops every open stream (the call ended): their requests leave the engine."""
        tasks = [s.task for s in self._streams.values() if s.task is not None]
        for stream_id in list(self._streams):
            self._cancel(stream_id)
        await asyncio.gather(*tasks, return_exceptions=True)

    def _open(self, opened: pb.OpenStream) -> None:
        if opened.id in self._streams:
            raise ProtocolError(f"stream {opened.id} is already open on this call", param="open.id")
        timeout = opened.timeout_seconds
        deadline = time.monotonic() + timeout if timeout > 0 else None
        stream = _Stream(opened.id, opened.window or DEFAULT_WINDOW, deadline)
        self._streams[opened.id] = stream

        def sink(event: pb.GenerateResponse) -> None:
            if self._streams.get(stream.id) is stream:  # else cancelled, its task not yet ended
                self._post(stream.id, event)

        events = self._open_events(opened, stream.remaining, sink)
        stream.task = asyncio.create_task(self._pump(stream, events))

    def _cancel(self, stream_id: int) -> None:
        stream = self._streams.pop(stream_id, None)
        self._outbox.pop(stream_id, None)
        if stream is not None and stream.task is not None:
            stream.cancelled = True
            stream.task.cancel()

    async def _pump(self, stream: _Stream, events: Events) -> None:
        """Moves a stream's first events (those before its generated ones) to the outbox while it
        has credit, then waits for its end; ends it with its status."""
        try:
            async with contextlib.aclosing(events), asyncio.timeout(stream.remaining()):
                async for event in events:
                    self._post(stream.id, event)
                    await stream.wait_for_credit()
            end = stream_end()
        except WorkerError as exc:
            end = stream_end(exc.to_status())
        except TimeoutError:
            end = _plain_end(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        except asyncio.CancelledError:
            if stream.cancelled:
                return  # the caller cancelled it: nothing more is sent for it
            raise
        except Exception as error:  # a bug in this request's path: it alone fails
            log.exception("stream %d failed", stream.id)
            end = _plain_end(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")
        if self._streams.pop(stream.id, None) is not None:
            self._outbox.setdefault(stream.id, _Entry()).end = end
            self._wake.set()

    def _post(self, stream_id: int, event: pb.GenerateResponse) -> None:
        entry = self._outbox.get(stream_id)
        if entry is None:
            self._outbox[stream_id] = _Entry([event])
        elif not (entry.events and merge_into(entry.events[-1], event)):
            entry.events.append(event)
        self._wake.set()

    def take(self) -> pb.StreamsResponse:
        """The next message: every outbox entry whose stream has credit (taking one) or ended;
        the others wait for credit. Each event is copied once, into the message."""
        message, waiting = pb.StreamsResponse(), {}
        add = message.streams.add
        for stream_id, entry in self._outbox.items():
            stream = self._streams.get(stream_id)
            if stream is not None:
                if stream.credit <= 0:
                    waiting[stream_id] = entry
                    continue
                stream.credit -= 1
            # else ended: its last events go with its end
            add(id=stream_id, events=entry.events, end=entry.end)
        self._outbox = waiting
        return message

    async def write_loop(self, write: Callable[[pb.StreamsResponse], Awaitable[None]]) -> None:
        """Sends a message whenever there is something to send, until the call is closed and
        every stream has ended."""
        while not (self._closed and not self._streams and not self._outbox):
            await self._wake.wait()
            self._wake.clear()
            message = self.take()
            if message.streams:
                await write(message)


async def serve_streams(context: grpc.aio.ServicerContext, open_events: OpenEvents) -> None:
    """Serves one ``GenerateStreams`` call: reads the caller's messages while writing the
    streams' events; when the call ends (or is cancelled) its open streams are dropped."""
    session = StreamsSession(open_events)
    reader = asyncio.create_task(_read_all(context, session))
    writer = asyncio.create_task(session.write_loop(context.write))
    try:
        done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
        if reader in done:
            reader.result()  # a ProtocolError ends the call
            await writer
        else:
            writer.result()
    except ProtocolError as error:
        await context.abort_with_status(error.to_status())
    finally:
        reader.cancel()
        writer.cancel()
        await session.cancel_all()


async def _read_all(context: grpc.aio.ServicerContext, session: StreamsSession) -> None:
    while True:
        message = await context.read()
        if message is grpc.aio.EOF:
            session.close()
            return
        if isinstance(message, UndecodableRequest):
            raise ProtocolError(message.error().message, param="request")
        assert isinstance(message, pb.StreamsRequest)  # grpc's read() is untyped
        session.receive(message)
