"""A client's multiplexed ``GenerateStreams`` calls: many requests to one worker on one call, each
read as a :class:`StreamCall` that behaves like ``sluice.client.GenerateCall``.

Notes: docs/shared.md; the protocol: docs/grpc.md, "Multiplexed streams".
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, cast

import grpc

from sluice.status import DETAILS_KEY, ErrorDetails, WorkerCallError, read_details
from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc

#: Messages a stream may be sent before it is read (``OpenStream.window``): a reader that falls
#: further behind gets its deltas merged by the worker, and the other streams are not held up.
WINDOW = 16
#: A stream gives credit back in batches of this many messages read, so the worker hears from it
#: once per this many steps rather than once per step.
GRANT_EVERY = WINDOW // 2
#: Credit alone waits this long for more before it is sent (opens and cancellations go at once):
#: a stream still has half its window, and the worker gets a few messages a step, not one per
#: stream (each is gRPC's per-message work on both sides).
CREDIT_DELAY_S = 0.005
#: A call takes new streams for this long, then a new call does: the old one ends with its last
#: stream, so no call lives past the worker's connection age and its grace (worker/server.py).
ROTATE_AFTER_S = 30.0

Metadata = Sequence[tuple[str, str | bytes]]


class EventCall(Protocol):
    """What ``GenerateCall`` and :class:`StreamCall` both are: one request's events."""

    async def read(self) -> pb.GenerateResponse | None: ...

    def cancel(self) -> bool: ...

    def done(self) -> bool: ...


Fallback = Callable[[pb.GenerateRequest, float | None, Metadata], EventCall]
#: Asks the worker whether it serves ``GenerateStreams`` (its ListModels answer says).
Probe = Callable[[], Awaitable[bool]]


def _error(code: grpc.StatusCode, message: str, details: bytes = b"") -> grpc.RpcError:
    trailing: tuple[tuple[str, str | bytes], ...] = ((DETAILS_KEY, details),) if details else ()
    plain = WorkerCallError(ErrorDetails(code, message), trailing)
    return WorkerCallError(read_details(plain), trailing)


def end_error(end: pb.StreamEnd) -> grpc.RpcError | None:
    """The ``WorkerCallError`` a stream's end says (None for OK), as ``Generate``'s status would."""
    if end.code == 0:
        return None
    codes = {code.value[0]: code for code in grpc.StatusCode}
    return _error(codes.get(end.code, grpc.StatusCode.UNKNOWN), end.message, end.details)


class StreamCall:
    """One request on a multiplexed call: :meth:`read` its events (None at the end; a failure is
    raised as ``WorkerCallError``), :meth:`cancel` it when done. It goes on a call once
    :meth:`attach`-ed, or as a ``Generate`` call once :meth:`divert`-ed (a worker without
    ``GenerateStreams``, or a call that failed before the worker answered on it)."""

    def __init__(self, stream_id: int, open_: pb.OpenStream, fallback: Fallback) -> None:
        self.id, self._open, self._fallback = stream_id, open_, fallback
        self._session: _Session | None = None
        self._deadline = time.monotonic() + open_.timeout_seconds if open_.timeout_seconds else None
        self._entries: collections.deque[list[pb.GenerateResponse]] = collections.deque()
        self._current: collections.deque[pb.GenerateResponse] = collections.deque()
        self._arrived = asyncio.Event()
        self._read_entries = 0  # entries taken since credit was last given back
        self._waiting = False  # read() waits for the next entry: nothing held, not ended
        # Takes a lone event straight from the worker's message while read() waits (False: it did
        # not, read() gets it): what reading it would do, without waking the reader (a hot path).
        self.inline: Callable[[pb.GenerateResponse], bool] | None = None
        self._ended = False
        self._failure: grpc.RpcError | None = None  # how it ended, when not OK
        self._instead: EventCall | None = None
        self._timer = (
            asyncio.get_running_loop().call_later(open_.timeout_seconds, self._expire)
            if open_.timeout_seconds
            else None
        )

    def deliver(self, entry: pb.StreamEvents) -> None:
        """The worker sent ``entry`` for this stream (its reader calls this). A lone event, while
        :meth:`read` waits and nothing else arrived, goes to :attr:`inline` when one is set."""
        events = entry.events
        if (
            self._waiting
            and self.inline is not None
            and len(events) == 1
            and not self._arrived.is_set()
            and not entry.HasField("end")
            and self.inline(events[0])
        ):
            self._took_entry()
            return
        if events:
            self._entries.append(list(events))
        if entry.HasField("end"):
            self._finish(end_error(entry.end))
        self._arrived.set()

    def attach(self, session: _Session) -> None:
        """Sends the request on ``session`` (unless it ended meanwhile)."""
        if not self._ended and self._instead is None:
            self._session = session
            session.open(self, self._open)

    def divert(self) -> None:
        """Sends the request as a ``Generate`` call instead, with what is left of its deadline."""
        if self._ended or self._instead is not None:
            return
        if self._session is not None:
            self._session.forget(self.id)
        remaining = None if self._deadline is None else max(0.001, self._deadline - time.monotonic())
        metadata = tuple(self._open.metadata.items())
        self._instead = self._fallback(self._open.request, remaining, metadata)
        self._arrived.set()

    def fail(self, error: grpc.RpcError) -> None:
        """The call this stream was on failed after the worker answered on it: so does the stream."""
        if not self._ended and self._instead is None:
            self._finish(error)
            self._arrived.set()

    async def read(self) -> pb.GenerateResponse | None:
        """The next event, or None once the stream ended OK."""
        while True:
            if self._current:
                return self._current.popleft()
            if self._entries:
                self._current.extend(self._entries.popleft())
                self._took_entry()
                continue
            if self._instead is not None:
                return await self._instead.read()
            if self._ended:
                if self._failure is None:
                    return None
                raise self._failure
            self._arrived.clear()
            self._waiting = True
            try:
                await self._arrived.wait()
            except asyncio.CancelledError:
                self.cancel()  # the reader is gone: so is the request
                raise
            finally:
                self._waiting = False

    def _took_entry(self) -> None:
        """An entry left the buffer: credit goes back every :data:`GRANT_EVERY` of them."""
        self._read_entries += 1
        if self._read_entries >= GRANT_EVERY and not self._ended and self._session is not None:
            self._session.grant(self.id, self._read_entries)
            self._read_entries = 0

    def __aiter__(self) -> StreamCall:
        return self

    async def __anext__(self) -> pb.GenerateResponse:
        event = await self.read()
        if event is None:
            raise StopAsyncIteration
        return event

    def cancel(self) -> bool:
        """Cancels the stream on the worker; idempotent. False if it had already ended."""
        if self._instead is not None:
            return self._instead.cancel()
        if self._ended:
            return False
        self._finish(_error(grpc.StatusCode.CANCELLED, "the call was cancelled by this client"))
        if self._session is not None:
            self._session.cancel(self.id)
        self._arrived.set()
        return True

    @property
    def multiplexed(self) -> bool:
        """False once the request went as a ``Generate`` call (a worker without GenerateStreams)."""
        return self._instead is None

    def done(self) -> bool:
        return self._instead.done() if self._instead is not None else self._ended

    def _finish(self, error: grpc.RpcError | None) -> None:
        if not self._ended:
            self._ended, self._failure = True, error
            if self._timer is not None:
                self._timer.cancel()
            if self._session is not None:
                self._session.forget(self.id)

    def _expire(self) -> None:
        """The deadline passed: the stream ends here as a ``Generate`` call's deadline ends it."""
        if not self._ended and self._instead is None:
            self._finish(_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            if self._session is not None:
                self._session.cancel(self.id)
            self._arrived.set()


class _Session:
    """One ``GenerateStreams`` call: its streams, what waits to be sent on it (batched into one
    message per event-loop turn), a writer and a reader task. Should the call fail before the
    worker's first answer on it, its streams go as ``Generate`` calls and ``unanswered`` is told."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, unanswered: Callable[[], None]) -> None:
        self.call: Any = stub.GenerateStreams()
        self.started = time.monotonic()
        self.retired = False
        self.answered = False  # the worker sent a message on this call
        self.closed = False  # this client cancelled the call
        self.streams: dict[int, StreamCall] = {}
        self._unanswered = unanswered
        self._outgoing = pb.StreamsRequest()
        self._wake = asyncio.Event()
        self._urgent: asyncio.Future[None] | None = None  # the credit delay, ended early by an open
        self._writer = asyncio.create_task(self._write_loop())
        self._reader = asyncio.create_task(self._read_loop())

    def open(self, stream: StreamCall, open_: pb.OpenStream) -> None:
        self.streams[stream.id] = stream
        self._outgoing.open.append(open_)
        self._hurry()

    def grant(self, stream_id: int, messages: int) -> None:
        self._outgoing.credit.extend([stream_id] * messages)
        self._wake.set()

    def cancel(self, stream_id: int) -> None:
        self._outgoing.cancel.append(stream_id)
        self._hurry()

    def forget(self, stream_id: int) -> None:
        self.streams.pop(stream_id, None)
        if self.retired and not self.streams:
            self._wake.set()  # the writer half-closes the call

    def retire(self) -> None:
        """Takes no more streams; ends once its streams have."""
        self.retired = True
        self._hurry()

    def _hurry(self) -> None:
        """Wakes the writer, cutting short a wait for more credit: an open or a cancellation goes
        at once."""
        self._wake.set()
        if self._urgent is not None and not self._urgent.done():
            self._urgent.set_result(None)

    async def _gather_credit(self) -> None:
        """Waits :data:`CREDIT_DELAY_S` for more credit, or less if an open or cancellation comes."""
        loop = asyncio.get_running_loop()
        self._urgent = urgent = loop.create_future()
        timer = loop.call_later(CREDIT_DELAY_S, _settle, urgent)
        try:
            await urgent
        finally:
            timer.cancel()
            self._urgent = None

    async def _write_loop(self) -> None:
        with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):
            while True:
                await self._wake.wait()
                if not (self._outgoing.open or self._outgoing.cancel) and not self.retired:
                    await self._gather_credit()  # credit alone: gather more first
                self._wake.clear()
                message, self._outgoing = self._outgoing, pb.StreamsRequest()
                if message.open or message.cancel or message.credit:
                    await self.call.write(message)
                if self.retired and not self.streams:
                    await self.call.done_writing()
                    return

    async def _read_loop(self) -> None:
        failure = _error(grpc.StatusCode.UNAVAILABLE, "the worker ended the streams call")
        try:
            while True:
                message = await self.call.read()
                if message is grpc.aio.EOF:
                    break
                self.answered = True
                for entry in cast(pb.StreamsResponse, message).streams:
                    stream = self.streams.get(entry.id)
                    if stream is not None:  # else cancelled meanwhile
                        stream.deliver(entry)
        except grpc.RpcError as error:
            failure = WorkerCallError.from_rpc_error(error)
        finally:
            self._ended(failure)

    def _ended(self, failure: grpc.RpcError) -> None:
        """The call ended: its open streams fail with ``failure``, or, when the worker never
        answered on it (whatever the status: a server without the method may say UNIMPLEMENTED,
        INTERNAL or UNKNOWN), go as ``Generate`` calls, never lost."""
        self.retired = True
        resend = not self.answered and not self.closed
        streams, self.streams = list(self.streams.values()), {}
        for stream in streams:
            if resend:
                stream.divert()
            else:
                stream.fail(failure)
        self._writer.cancel()
        if resend:
            self._unanswered()

    def close(self) -> None:
        self.closed = True
        self.call.cancel()


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class StreamsChannel:
    """The multiplexed calls of one client to one worker: :meth:`open` starts a request on the
    current call (a new call every :data:`ROTATE_AFTER_S`, or after one failed). Before the first
    request goes on a call, ``probe`` learns whether the worker serves ``GenerateStreams``;
    ``fallback`` starts a ``Generate`` call, for the requests of a worker that does not."""

    def __init__(
        self, stub: Callable[[], worker_pb2_grpc.WorkerStub], fallback: Fallback, probe: Probe
    ) -> None:
        self._stub, self._fallback, self._probe = stub, fallback, probe
        self._session: _Session | None = None
        self._ids = itertools.count(1)
        self.serves: bool | None = None  # whether the worker serves GenerateStreams (None: not known)
        self._learnt_at = 0.0
        self._waiting: list[StreamCall] = []  # opened while the probe is out
        self._probing: asyncio.Task[None] | None = None

    def open(self, request: pb.GenerateRequest, timeout: float | None, metadata: Metadata) -> EventCall:
        """Starts ``request`` (deadline ``timeout`` seconds, None: none; ``metadata`` as
        ``Generate``'s call metadata, string values only) and returns its call."""
        if self.serves is False and time.monotonic() - self._learnt_at < ROTATE_AFTER_S:
            return self._fallback(request, timeout, metadata)
        open_ = pb.OpenStream(
            id=next(self._ids),
            request=request,
            timeout_seconds=timeout or 0.0,
            metadata={k: v for k, v in metadata if isinstance(v, str)},
            window=WINDOW,
        )
        stream = StreamCall(open_.id, open_, self._fallback)
        if self.serves:
            stream.attach(self._current())
        else:  # not known, or known not to and time to ask again
            self._waiting.append(stream)
            if self._probing is None:
                self._probing = asyncio.create_task(self._learn())
        return stream

    async def _learn(self) -> None:
        """Asks the worker (:data:`Probe`), then sends the requests that waited: on a call, or as
        ``Generate`` calls when it does not serve ``GenerateStreams`` or did not answer (then
        the next request asks again)."""
        serves: bool | None = None
        try:
            serves = await self._probe()
        except grpc.RpcError:
            pass  # unreachable, loading, or no ListModels: its requests go as Generate calls
        finally:
            self.serves, self._learnt_at, self._probing = serves, time.monotonic(), None
            waiting, self._waiting = self._waiting, []
            for stream in waiting:
                if serves:
                    stream.attach(self._current())
                else:
                    stream.divert()

    def _relearn(self) -> None:
        """A call failed before the worker answered on it (it may have restarted as another
        version): the next request asks again."""
        self.serves = None

    def _current(self) -> _Session:
        session = self._session
        if (
            session is not None
            and not session.retired
            and time.monotonic() - session.started < ROTATE_AFTER_S
        ):
            return session
        if session is not None:
            session.retire()
        self._session = _Session(self._stub(), self._relearn)
        return self._session

    def close(self) -> None:
        """Cancels the current call and the requests waiting for the probe (CANCELLED)."""
        waiting, self._waiting = self._waiting, []
        for stream in waiting:
            stream.fail(_error(grpc.StatusCode.CANCELLED, "the channel was closed by this client"))
        if self._probing is not None:
            self._probing.cancel()
        if self._session is not None:
            self._session.close()
            self._session = None
