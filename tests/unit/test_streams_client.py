"""The client's multiplexed calls (sluice/streams.py) over a fake bidirectional call: each stream
reads its own events, credit goes back as entries are read, a failed call fails its streams, a
worker that does not say it serves GenerateStreams gets Generate calls, and a call that fails
before the worker's first answer re-sends its requests as Generate calls."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
import pytest

from sluice import streams
from sluice.status import WorkerCallError
from sluice.streams import GRANT_EVERY, EventCall, Metadata, StreamsChannel
from sluice.v1 import worker_pb2 as pb


def in_loop(body: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """A test that runs ``body`` in a fresh event loop."""

    def test() -> None:
        asyncio.run(body())

    test.__name__, test.__doc__ = body.__name__, body.__doc__
    return test


class FakeBidi:
    """A ``GenerateStreams`` call: records what the client writes, answers what the test queues."""

    def __init__(self) -> None:
        self.written: list[pb.StreamsRequest] = []
        self.responses: asyncio.Queue[pb.StreamsResponse | Exception] = asyncio.Queue()
        self.wrote = asyncio.Event()

    async def write(self, message: pb.StreamsRequest) -> None:
        self.written.append(message)
        self.wrote.set()

    async def read(self) -> pb.StreamsResponse:
        item = await self.responses.get()
        if isinstance(item, Exception):
            raise item
        return item

    async def done_writing(self) -> None:
        pass

    def cancel(self) -> bool:
        return True

    def sent(self, field: str) -> list[Any]:
        return [item for message in self.written for item in getattr(message, field)]


class FakeStub:
    def __init__(self) -> None:
        self.calls: list[FakeBidi] = []
        self.called = asyncio.Event()

    def GenerateStreams(self) -> FakeBidi:
        self.calls.append(FakeBidi())
        self.called.set()
        return self.calls[-1]


class FakeGenerate:
    """A ``Generate`` call (the fallback): one content event, then the end."""

    def __init__(self, request: pb.GenerateRequest) -> None:
        self.request, self.events = request, [pb.GenerateResponse(content=pb.ContentDelta(text="fallback"))]

    async def read(self) -> pb.GenerateResponse | None:
        return self.events.pop(0) if self.events else None

    def cancel(self) -> bool:
        return True

    def done(self) -> bool:
        return not self.events


class FakeProbe:
    """The worker's ListModels answer on ``GenerateStreams`` (``serves``, or ``error`` raised)."""

    def __init__(self, serves: bool = True, error: Exception | None = None) -> None:
        self.serves, self.error, self.asked = serves, error, 0

    async def __call__(self) -> bool:
        self.asked += 1
        if self.error is not None:
            raise self.error
        return self.serves


def channel_of(
    stub: FakeStub, fallbacks: list[FakeGenerate], probe: FakeProbe | None = None
) -> StreamsChannel:
    def fallback(request: pb.GenerateRequest, timeout: float | None, metadata: Metadata) -> EventCall:
        fallbacks.append(FakeGenerate(request))
        return fallbacks[-1]

    return StreamsChannel(lambda: stub, fallback, probe or FakeProbe())  # type: ignore[arg-type, return-value]


def rpc_error(code: grpc.StatusCode, message: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), message)


async def call_of(stub: FakeStub, index: int = 0) -> FakeBidi:
    """The ``index``-th call, once the probe answered and the channel made it."""
    while len(stub.calls) <= index:
        stub.called.clear()
        await asyncio.wait_for(stub.called.wait(), 5)
    return stub.calls[index]


def text(value: str) -> pb.GenerateResponse:
    return pb.GenerateResponse(content=pb.ContentDelta(text=value))


async def written(call: FakeBidi, field: str, count: int) -> list[Any]:
    """Waits until ``count`` items of ``field`` were written on ``call``."""
    while len(call.sent(field)) < count:
        call.wrote.clear()
        await asyncio.wait_for(call.wrote.wait(), 5)
    return call.sent(field)


async def read_all(stream: EventCall) -> list[str]:
    texts = []
    while (event := await asyncio.wait_for(stream.read(), 5)) is not None:  # 5 s: a hang fails
        texts.append(event.content.text)
    return texts


@in_loop
async def test_each_stream_reads_its_own_events_and_gives_credit_back_in_batches() -> None:
    stub = FakeStub()
    channel = channel_of(stub, [])
    first = channel.open(pb.GenerateRequest(request_id="a"), 30.0, [("traceparent", "00-x")])
    second = channel.open(pb.GenerateRequest(request_id="b"), None, ())
    call = await call_of(stub)  # one call for both
    opened = await written(call, "open", 2)
    assert [o.request.request_id for o in opened] == ["a", "b"]
    assert opened[0].metadata["traceparent"] == "00-x" and opened[0].timeout_seconds == 30.0
    ids = [o.id for o in opened]
    for step in range(GRANT_EVERY):  # one message per step, each with both streams' entries
        call.responses.put_nowait(
            pb.StreamsResponse(
                streams=[
                    pb.StreamEvents(id=ids[1], events=[text(f"b{step}")]),
                    pb.StreamEvents(id=ids[0], events=[text(f"a{step}")]),
                ]
            )
        )
    for step in range(GRANT_EVERY):
        assert (await first.read()).content.text == f"a{step}"  # type: ignore[union-attr]
        assert (await second.read()).content.text == f"b{step}"  # type: ignore[union-attr]
    # Credit comes back in one batch per stream once GRANT_EVERY entries were read.
    assert sorted(await written(call, "credit", 2 * GRANT_EVERY)) == sorted(ids * GRANT_EVERY)
    call.responses.put_nowait(
        pb.StreamsResponse(
            streams=[
                pb.StreamEvents(id=ids[0], events=[text("last")], end=pb.StreamEnd()),
                pb.StreamEvents(id=ids[1], end=pb.StreamEnd()),
            ]
        )
    )
    assert await read_all(first) == ["last"]
    assert await read_all(second) == []
    assert len(call.sent("credit")) == 2 * GRANT_EVERY  # none for an ended stream


@in_loop
async def test_a_stream_ends_with_the_workers_status_for_it() -> None:
    stub = FakeStub()
    stream = channel_of(stub, []).open(pb.GenerateRequest(), None, ())
    call = await call_of(stub)
    [opened] = await written(call, "open", 1)
    end = pb.StreamEnd(code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message="queue full")
    call.responses.put_nowait(pb.StreamsResponse(streams=[pb.StreamEvents(id=opened.id, end=end)]))
    with pytest.raises(WorkerCallError) as failure:
        await stream.read()
    assert (
        failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and failure.value.message == "queue full"
    )


@in_loop
async def test_a_failed_call_fails_its_open_streams_and_the_next_request_opens_a_new_call() -> None:
    stub = FakeStub()
    channel = channel_of(stub, [])
    streams = [channel.open(pb.GenerateRequest(), None, ()) for _ in range(2)]
    call = await call_of(stub)
    await written(call, "open", 2)
    call.responses.put_nowait(pb.StreamsResponse())  # the worker answered on the call
    call.responses.put_nowait(rpc_error(grpc.StatusCode.UNAVAILABLE, "gone"))
    for stream in streams:
        with pytest.raises(WorkerCallError) as failure:
            await stream.read()
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    channel.open(pb.GenerateRequest(), None, ())
    assert len(stub.calls) == 2


@in_loop
async def test_a_worker_that_does_not_say_it_serves_generate_streams_gets_generate_calls() -> None:
    stub, fallbacks, probe = FakeStub(), [], FakeProbe(serves=False)
    channel = channel_of(stub, fallbacks, probe)
    streams = [channel.open(pb.GenerateRequest(request_id=f"old-{i}"), 30.0, ()) for i in range(2)]
    assert [await read_all(stream) for stream in streams] == [["fallback"], ["fallback"]]
    assert [f.request.request_id for f in fallbacks] == ["old-0", "old-1"]
    later = channel.open(pb.GenerateRequest(request_id="later"), None, ())
    assert await read_all(later) == ["fallback"]
    assert (stub.calls, probe.asked) == ([], 1)  # asked once, never a GenerateStreams call


@in_loop
async def test_a_probe_that_fails_sends_generate_calls_and_the_next_request_asks_again() -> None:
    stub, fallbacks = FakeStub(), []
    probe = FakeProbe(error=rpc_error(grpc.StatusCode.UNIMPLEMENTED, "Method not found!"))
    channel = channel_of(stub, fallbacks, probe)
    assert await read_all(channel.open(pb.GenerateRequest(), None, ())) == ["fallback"]
    probe.error = None
    stream = channel.open(pb.GenerateRequest(), None, ())
    await written(await call_of(stub), "open", 1)
    assert probe.asked == 2 and stream.multiplexed  # type: ignore[attr-defined]


# However a server without the method fails the call: gRPC's own UNIMPLEMENTED, or INTERNAL or
# UNKNOWN from the generated base class's NotImplementedError, or a worker restarting.
BEFORE_ANY_ANSWER = [
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.UNAVAILABLE,
]


@pytest.mark.parametrize("code", BEFORE_ANY_ANSWER, ids=lambda code: code.name)
def test_a_call_that_fails_before_its_first_answer_resends_its_requests_as_generate(
    code: grpc.StatusCode,
) -> None:
    async def body() -> None:
        stub, fallbacks, probe = FakeStub(), [], FakeProbe()
        channel = channel_of(stub, fallbacks, probe)
        streams = [channel.open(pb.GenerateRequest(request_id=f"r{i}"), 30.0, ()) for i in range(2)]
        call = await call_of(stub)
        await written(call, "open", 2)
        call.responses.put_nowait(rpc_error(code, "Method not implemented!"))
        assert [await read_all(stream) for stream in streams] == [["fallback"], ["fallback"]]
        assert sorted(f.request.request_id for f in fallbacks) == ["r0", "r1"]
        assert not any(stream.multiplexed for stream in streams)  # type: ignore[attr-defined]
        channel.open(pb.GenerateRequest(), None, ())
        await call_of(stub, 1)
        assert probe.asked == 2  # it may have restarted as another version: asked again

    asyncio.run(body())


@in_loop
async def test_a_call_closed_by_its_client_resends_nothing() -> None:
    stub, fallbacks = FakeStub(), []
    channel = channel_of(stub, fallbacks)
    stream = channel.open(pb.GenerateRequest(), None, ())
    call = await call_of(stub)
    await written(call, "open", 1)
    channel.close()
    call.responses.put_nowait(rpc_error(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"))
    with pytest.raises(WorkerCallError) as failure:
        await stream.read()
    assert failure.value.code() == grpc.StatusCode.CANCELLED and fallbacks == []


@in_loop
async def test_cancelling_a_stream_tells_the_worker_and_ends_its_reads() -> None:
    stub = FakeStub()
    stream = channel_of(stub, []).open(pb.GenerateRequest(), None, ())
    call = await call_of(stub)
    [opened] = await written(call, "open", 1)
    assert stream.cancel()
    assert await written(call, "cancel", 1) == [opened.id]
    with pytest.raises(WorkerCallError) as failure:
        await stream.read()
    assert failure.value.code() == grpc.StatusCode.CANCELLED


def test_an_open_does_not_wait_behind_credit_gathering(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credit alone waits CREDIT_DELAY_S for more, but an open or a cancellation that arrives
    meanwhile goes at once (it waited out the delay: a new request's first token came up to 5 ms
    late whenever other streams' credit was being gathered). The delay is made an hour here: a
    request that waited for it would fail the 5 s wait."""
    monkeypatch.setattr(streams, "CREDIT_DELAY_S", 3600.0)

    async def body() -> None:
        stub = FakeStub()
        channel = channel_of(stub, [])
        first = channel.open(pb.GenerateRequest(request_id="a"), None, ())
        call = await call_of(stub)
        [opened] = await written(call, "open", 1)
        for step in range(GRANT_EVERY):
            call.responses.put_nowait(
                pb.StreamsResponse(streams=[pb.StreamEvents(id=opened.id, events=[text(f"{step}")])])
            )
        for _ in range(GRANT_EVERY):
            await asyncio.wait_for(first.read(), 5)
        await asyncio.sleep(0)  # the writer is now gathering credit
        assert call.sent("credit") == []
        second = channel.open(pb.GenerateRequest(request_id="b"), None, ())
        assert [o.request.request_id for o in await written(call, "open", 2)] == ["a", "b"]
        assert call.sent("credit") == [opened.id] * GRANT_EVERY  # it went with the open
        assert second.cancel() and first.cancel()
        assert len(await written(call, "cancel", 2)) == 2

    asyncio.run(body())


@in_loop
async def test_a_waiting_readers_lone_events_go_to_its_inline_taker_in_order_with_credit() -> None:
    """While ``read`` waits, a lone event goes to ``inline`` without waking the reader, and counts
    toward credit as a read one does; a refused event, a message of several events and the end
    come through ``read``, in order."""
    stub = FakeStub()
    stream = channel_of(stub, []).open(pb.GenerateRequest(request_id="a"), None, ())
    call = await call_of(stub)
    (opened,) = await written(call, "open", 1)
    taken: list[str] = []
    accept = True

    def inline(event: pb.GenerateResponse) -> bool:
        if accept:
            taken.append(event.content.text)
        return accept

    stream.inline = inline  # type: ignore[union-attr]

    async def send(*entries: pb.StreamEvents) -> None:
        call.responses.put_nowait(pb.StreamsResponse(streams=list(entries)))
        for _ in range(5):  # the channel's reader delivers it
            await asyncio.sleep(0)

    await send(pb.StreamEvents(id=opened.id, events=[text("x")]))  # nobody reads yet: it waits
    assert (await asyncio.wait_for(stream.read(), 5)).content.text == "x" and taken == []  # type: ignore[union-attr]
    reader = asyncio.ensure_future(stream.read())
    await asyncio.sleep(0)  # the reader waits now
    for step in range(GRANT_EVERY):
        await send(pb.StreamEvents(id=opened.id, events=[text(f"i{step}")]))
    assert taken == [f"i{step}" for step in range(GRANT_EVERY)] and not reader.done()
    assert await written(call, "credit", GRANT_EVERY) == [opened.id] * GRANT_EVERY  # taken ones count
    await send(pb.StreamEvents(id=opened.id, events=[text("two"), text("events")]))
    assert (await asyncio.wait_for(reader, 5)).content.text == "two"  # type: ignore[union-attr]
    assert (await stream.read()).content.text == "events"  # type: ignore[union-attr]
    accept = False
    reader = asyncio.ensure_future(stream.read())
    await send(pb.StreamEvents(id=opened.id, events=[text("refused")]))
    assert (await asyncio.wait_for(reader, 5)).content.text == "refused"  # type: ignore[union-attr]
    accept = True
    reader = asyncio.ensure_future(read_all(stream))
    await send(pb.StreamEvents(id=opened.id, events=[text("last")], end=pb.StreamEnd()))
    assert await asyncio.wait_for(reader, 5) == ["last"] and taken[-1] == f"i{GRANT_EVERY - 1}"
