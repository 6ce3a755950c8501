"""GenerateStreams' session (worker/service/streams.py) with fake streams: one message carries every
stream's events, credit per stream, merging, per-stream ends, cancellation and deadlines."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

import grpc

from sluice.streams import end_error
from sluice.v1 import worker_pb2 as pb
from worker.errors import InvalidRequest
from worker.service.drain import DrainingWorker
from worker.service.streams import Sink, StreamsSession


def in_loop(body: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """A test that runs ``body`` in a fresh event loop."""

    def test() -> None:
        asyncio.run(body())

    test.__name__, test.__doc__ = body.__name__, body.__doc__
    return test


class Yielded:
    """An event the stream yields (as the servicer yields those before the generated ones)."""

    def __init__(self, event: pb.GenerateResponse) -> None:
        self.event = event


class FakeStream:
    """A request's events, fed by the test: each goes to the session's sink (as a step's generated
    events do), a :class:`Yielded` one is yielded; counts how many the session pulled."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[pb.GenerateResponse | Yielded | Exception | None] = asyncio.Queue()
        self.pulled = 0
        self.closed = asyncio.Event()

    async def events(self, sink: Sink) -> AsyncGenerator[pb.GenerateResponse, None]:
        try:
            while True:
                item = await self.queue.get()
                self.pulled += 1
                if item is None:
                    return
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, Yielded):
                    yield item.event
                else:
                    sink(item)
        finally:
            self.closed.set()


def content(text: str, ids: tuple[int, ...] = ()) -> pb.GenerateResponse:
    return pb.GenerateResponse(content=pb.ContentDelta(choice_index=0, text=text, token_ids=ids))


def session_of(streams: dict[int, FakeStream]) -> StreamsSession:
    def open_events(
        opened: pb.OpenStream, remaining: Callable[[], float | None], sink: Sink
    ) -> AsyncGenerator:
        return streams[opened.id].events(sink)

    return StreamsSession(open_events)


def open_message(*ids: int, window: int = 0, timeout: float = 0.0) -> pb.StreamsRequest:
    return pb.StreamsRequest(
        open=[
            pb.OpenStream(id=i, request=pb.GenerateRequest(), window=window, timeout_seconds=timeout)
            for i in ids
        ]
    )


async def settle() -> None:
    """Lets every ready task run (the pumps move what their streams hold)."""
    for _ in range(5):
        await asyncio.sleep(0)


@in_loop
async def test_one_message_carries_every_streams_events_and_merges_a_streams_deltas() -> None:
    streams = {1: FakeStream(), 2: FakeStream()}
    session = session_of(streams)
    session.receive(open_message(1, 2))
    for item in (content("a"), content("b", (7,))):
        streams[1].queue.put_nowait(item)
    streams[2].queue.put_nowait(content("x"))
    await settle()
    message = session.take()
    by_id = {entry.id: list(entry.events) for entry in message.streams}
    assert [e.content.text for e in by_id[1]] == ["ab"]  # one step's deltas of one stream merge
    assert list(by_id[1][0].content.token_ids) == [7]
    assert [e.content.text for e in by_id[2]] == ["x"]
    assert not session.take().streams  # nothing waits
    await session.cancel_all()


@in_loop
async def test_a_stream_without_credit_waits_while_the_others_go_on() -> None:
    slow, fast = FakeStream(), FakeStream()
    session = session_of({1: slow, 2: fast})
    session.receive(open_message(1, 2, window=1))
    slow.queue.put_nowait(content("s1"))
    fast.queue.put_nowait(content("f1"))
    await settle()
    assert {e.id for e in session.take().streams} == {1, 2}  # each spends its one credit
    session.receive(pb.StreamsRequest(credit=[2]))  # only the fast reader grants more
    for text in ("s2", "s3"):
        slow.queue.put_nowait(content(text))
    fast.queue.put_nowait(content("f2"))
    await settle()
    # No credit: the slow stream's steps wait in the outbox, merged, and its request goes on.
    assert slow.pulled == 3
    message = session.take()
    assert [(e.id, e.events[0].content.text) for e in message.streams] == [(2, "f2")]
    session.receive(pb.StreamsRequest(credit=[1]))
    await settle()
    assert [e.content.text for e in session.take().streams[0].events] == ["s2s3"]
    await session.cancel_all()


@in_loop
async def test_a_yielded_event_waits_for_credit_before_the_stream_goes_on() -> None:
    """The events before the generated ones (``started``) are pulled one credit at a time."""
    stream = FakeStream()
    session = session_of({1: stream})
    session.receive(open_message(1, window=1))
    stream.queue.put_nowait(Yielded(content("first")))
    await settle()
    assert [e.content.text for e in session.take().streams[0].events] == ["first"]  # the one credit
    for item in (Yielded(content("second")), content("third")):
        stream.queue.put_nowait(item)
    await settle()
    assert stream.pulled == 2  # no credit: the pump waits before it reads on
    assert not session.take().streams
    session.receive(pb.StreamsRequest(credit=[1]))
    await settle()
    assert stream.pulled == 3
    assert [e.content.text for e in session.take().streams[0].events] == ["secondthird"]
    await session.cancel_all()


@in_loop
async def test_each_stream_ends_with_its_own_status() -> None:
    good, bad = FakeStream(), FakeStream()
    session = session_of({1: good, 2: bad})
    session.receive(open_message(1, 2))
    bad.queue.put_nowait(InvalidRequest("max_tokens is too large", param="sampling.max_tokens"))
    good.queue.put_nowait(content("ok"))
    good.queue.put_nowait(None)
    await settle()
    ends = {entry.id: entry for entry in session.take().streams}
    assert ends[1].end.code == 0 and ends[1].events[0].content.text == "ok"
    error = end_error(ends[2].end)
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.param == "sampling.max_tokens"  # type: ignore[attr-defined]
    assert session.open_streams == 0


@in_loop
async def test_a_cancelled_stream_is_closed_and_sends_nothing_more() -> None:
    kept, cancelled = FakeStream(), FakeStream()
    session = session_of({1: kept, 2: cancelled})
    session.receive(open_message(1, 2))
    cancelled.queue.put_nowait(content("unsent"))
    await settle()
    session.receive(pb.StreamsRequest(cancel=[2]))
    await asyncio.wait_for(cancelled.closed.wait(), 5)  # its request leaves the engine
    kept.queue.put_nowait(content("k"))
    await settle()
    assert [entry.id for entry in session.take().streams] == [1]
    await session.cancel_all()
    assert kept.closed.is_set()


@in_loop
async def test_a_stream_past_its_deadline_ends_with_deadline_exceeded() -> None:
    stream = FakeStream()
    session = session_of({1: stream})
    sent: list[pb.StreamsResponse] = []

    async def write(message: pb.StreamsResponse) -> None:
        sent.append(message)

    writer = asyncio.create_task(session.write_loop(write))
    session.receive(open_message(1, timeout=0.01))
    await asyncio.wait_for(stream.closed.wait(), 5)  # nothing ever came: the deadline ends it
    session.close()
    await asyncio.wait_for(writer, 5)
    assert sent[-1].streams[0].end.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


class FakeService:
    """The servicer's ``stream_events``, fed by fake streams."""

    def __init__(self, streams: dict[int, FakeStream]) -> None:
        self.streams = streams

    def stream_events(
        self, opened: pb.OpenStream, remaining: Callable[[], float | None], sink: Sink
    ) -> AsyncGenerator:
        return self.streams[opened.id].events(sink)


@in_loop
async def test_a_draining_worker_refuses_new_streams_and_cuts_open_ones_when_the_grace_ends() -> None:
    open_, late = FakeStream(), FakeStream()
    draining = DrainingWorker(FakeService({1: open_, 2: late}))  # type: ignore[arg-type]
    session = StreamsSession(draining.stream_events)
    session.receive(open_message(1))
    open_.queue.put_nowait(content("a"))
    await settle()
    assert draining.in_flight == 1  # a stream counts as a call in flight
    draining.start_drain()
    session.receive(open_message(2))
    await settle()
    assert draining.cut() == 1
    await asyncio.wait_for(open_.closed.wait(), 5)  # its request leaves the engine
    await settle()
    entries = {entry.id: entry for entry in session.take().streams}
    assert entries[1].events[0].content.text == "a"
    for stream_id in (1, 2):
        error = end_error(entries[stream_id].end)
        assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
    assert late.pulled == 0 and draining.in_flight == 0
