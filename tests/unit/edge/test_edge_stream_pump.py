"""The stream pump (edge/streaming/pump.py) with fake calls: coalescing, the one clock, failures,
cancellation and the metrics it reports. No gRPC and no HTTP: the test plays Quart's part (it
iterates the pump and closes it)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import pytest
from edge_fakes import content, finished, run, started, usage

from edge.deadlines import TimeLimits
from edge.errors import EdgeError, ServerShuttingDownError, ServiceUnavailableError
from edge.streaming import sse
from edge.streaming.pump import MAX_PENDING_EVENTS, OPENAI_FRAMING, PumpClock, StreamFraming, StreamPump
from edge.surfaces.chat.translate import ChatTranslator
from edge.workers.call_group import CallGroup
from sluice.v1 import worker_pb2

END = object()


class FakeStream:
    """A started call: yields its first event, then what the test puts in :attr:`queue`
    (an exception is raised, :data:`END` ends the call)."""

    def __init__(self, first: worker_pb2.GenerateResponse | None = None) -> None:
        self.first = first or started()
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.cancelled = False
        self.reads = 0
        self.worker_address = "fake"
        self.worker_id = self.first.started.worker_id

    def __aiter__(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        return self._events()

    async def _events(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        yield self.first
        while True:
            item = await self.queue.get()
            self.reads += 1
            if item is END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def put(self, *items: Any) -> None:
        for item in items:
            self.queue.put_nowait(item)

    def cancel(self) -> None:
        self.cancelled = True


class FakeMetrics:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.surfaces: set[str] = set()

    def stream_opened(self, surface: str) -> None:
        self.surfaces.add(surface)
        self.calls.append(("opened", None))

    def stream_closed(self, surface: str, *, disconnected: bool) -> None:
        self.calls.append(("closed", disconnected))

    def first_output(self, surface: str, seconds: float) -> None:
        self.calls.append(("first_output", None))

    def output_gap(self, surface: str, seconds: float) -> None:
        self.calls.append(("gap", None))

    def stream_error(self, surface: str, kind: str, code: str) -> None:
        self.calls.append(("error", (kind, code)))

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


class FakeDrain:
    def __init__(self) -> None:
        self.registered: set[Any] = set()

    def add(self, stoppable: Any) -> None:
        self.registered.add(stoppable)

    def discard(self, stoppable: Any) -> None:
        self.registered.discard(stoppable)


def make_pump(
    streams: list[FakeStream],
    *,
    idle_s: float = 30.0,
    total_s: float = 60.0,
    heartbeat_s: float = 30.0,
    framing: StreamFraming = OPENAI_FRAMING,
    metrics: FakeMetrics | None = None,
    drain: FakeDrain | None = None,
    write_interval_s: float = 0.0,
    group: CallGroup | None = None,
) -> tuple[StreamPump, ChatTranslator]:
    builder = ChatTranslator("chatcmpl-1", 1, "m", include_usage=True)
    loop = asyncio.get_running_loop()
    clock = PumpClock(
        limits=TimeLimits(total_s=total_s, idle_s=idle_s),
        deadline=loop.time() + total_s,
        heartbeat_s=heartbeat_s,
        write_timeout_s=30.0,
        write_interval_s=write_interval_s,
    )
    pump = StreamPump(
        group or CallGroup(streams),
        lambda _call, event: builder.on_event(0, event),
        builder.finish,
        framing,
        clock,
        metrics=metrics or FakeMetrics(),
        drain=drain or FakeDrain(),
        request_id="req-1",
        started_at=loop.time(),
    )
    return pump, builder


def frames(write: bytes) -> list[str]:
    return [f for f in write.decode().split("\n\n") if f]


def deltas(write: bytes) -> list[dict[str, Any]]:
    chunks = [json.loads(f[6:]) for f in frames(write) if f.startswith("data: {")]
    return [c["choices"][0]["delta"] for c in chunks if c["choices"]]


async def settled(reads: Callable[[], int]) -> int:
    """Yields to the event loop until ``reads()`` stays the same for 100 turns (the readers did
    all they can without time passing: the fakes need none) and returns it; no wall-clock wait."""
    last, still = reads(), 0
    while still < 100:
        await asyncio.sleep(0)
        now = reads()
        still, last = (still + 1 if now == last else 0), now
    return last


async def drain_pump(pump: StreamPump) -> list[bytes]:
    writes = [write async for write in pump]
    await pump.aclose()
    return writes


def test_events_ready_together_go_out_in_one_write_with_deltas_merged() -> None:
    async def body() -> None:
        stream = FakeStream()
        stream.put(content("Hel"), content("lo"), content(" you"), finished(), usage(), END)
        metrics = FakeMetrics()
        pump, _ = make_pump([stream], metrics=metrics)
        writes = await drain_pump(pump)
        assert len(writes) == 1  # role, merged content, finish, usage and [DONE]: one write
        assert deltas(writes[0]) == [{"role": "assistant", "content": ""}, {"content": "Hello you"}, {}]
        assert frames(writes[0])[-1] == "data: [DONE]"
        assert metrics.names() == ["opened", "first_output", "closed"]
        assert metrics.calls[-1] == ("closed", False)

    run(body())


def test_events_arriving_one_at_a_time_are_written_one_at_a_time() -> None:
    async def body() -> None:
        stream = FakeStream()
        metrics = FakeMetrics()
        pump, _ = make_pump([stream], metrics=metrics)
        assert deltas(await anext(pump)) == [{"role": "assistant", "content": ""}]
        for text in ("a", "b"):
            stream.put(content(text))
            assert deltas(await anext(pump)) == [{"content": text}]
        stream.put(finished(), usage(), END)
        last = await anext(pump)
        assert frames(last)[-1] == "data: [DONE]"
        with pytest.raises(StopAsyncIteration):
            await anext(pump)
        await pump.aclose()
        assert metrics.names() == ["opened", "first_output", "gap", "gap", "closed"]  # a, b, finish

    run(body())


def test_a_slow_writer_bounds_what_the_reader_takes() -> None:
    async def body() -> None:
        stream = FakeStream()
        pump, _ = make_pump([stream])
        await anext(pump)  # the role chunk; now the "client" does not ask for more for a while
        stream.put(*(content("x") for _ in range(3 * MAX_PENDING_EVENTS)))
        assert await settled(lambda: stream.reads) == MAX_PENDING_EVENTS  # the reader waits instead
        write = await anext(pump)
        assert deltas(write) == [{"content": "x" * MAX_PENDING_EVENTS}]  # merged into one chunk
        assert await settled(lambda: stream.reads) == 2 * MAX_PENDING_EVENTS
        await pump.aclose()
        assert stream.cancelled

    run(body())


def test_a_slow_writer_bounds_what_several_calls_read() -> None:
    async def body() -> None:
        calls = [FakeStream(), FakeStream()]
        pump, _ = make_pump(calls)
        await anext(pump)
        for call in calls:
            call.put(*(content("x") for _ in range(2 * MAX_PENDING_EVENTS)))
        read = await settled(lambda: sum(call.reads for call in calls))
        # The pump's reader stops at the bound; the group reads at most two events per call beyond it.
        assert MAX_PENDING_EVENTS <= read <= MAX_PENDING_EVENTS + 4
        await pump.aclose()
        assert all(call.cancelled for call in calls)

    run(body())


def test_the_pump_writes_what_the_call_group_reads() -> None:
    class OneRead(CallGroup):
        """A group whose one read of its calls is scripted: the pump has no other way to them."""

        def events(self) -> AsyncGenerator[tuple[int, worker_pb2.GenerateResponse], None]:
            async def read() -> AsyncGenerator[tuple[int, worker_pb2.GenerateResponse], None]:
                for event in (started(), content("through "), content("the group"), finished(), usage()):
                    yield 0, event

            return read()

    async def body() -> None:
        pump, _ = make_pump([], group=OneRead([FakeStream()]))
        text = "".join(d.get("content", "") for w in await drain_pump(pump) for d in deltas(w))
        assert text == "through the group"

    run(body())


# Long enough that a held write is only ever released by the stream's end or a failure here.
HOLD_S = 3600.0


def test_output_within_the_write_interval_waits_and_goes_out_merged() -> None:
    async def body() -> None:
        stream = FakeStream()
        metrics = FakeMetrics()
        pump, _ = make_pump([stream], metrics=metrics, write_interval_s=HOLD_S)
        assert deltas(await anext(pump)) == [{"role": "assistant", "content": ""}]
        stream.put(content("a"))
        assert deltas(await anext(pump)) == [{"content": "a"}]  # the first output never waits
        next_write = asyncio.ensure_future(anext(pump))
        for text in ("b", "c", "d"):  # one at a time, each read before the next arrives
            stream.put(content(text))
            await settled(lambda: stream.reads)
        assert stream.reads == 4 and not next_write.done()  # read, held for the interval
        stream.put(finished(), usage(), END)  # the end is never held
        last = await next_write
        assert deltas(last) == [{"content": "bcd"}, {}]
        assert frames(last)[-1] == "data: [DONE]"
        await pump.aclose()
        assert metrics.names() == ["opened", "first_output", "gap", "closed"]

    run(body())


def test_output_due_within_a_quarter_of_the_write_interval_goes_at_once() -> None:
    """A worker pacing the call hands over about an interval apart, a little early as often as
    late: what comes in the interval's last quarter is not held for the rest of it."""

    async def body() -> None:
        stream = FakeStream()
        pump, _ = make_pump([stream], write_interval_s=HOLD_S)
        await anext(pump)  # the role
        stream.put(content("a"))
        await anext(pump)  # the first output: never held
        loop = asyncio.get_running_loop()
        for since, held in ((0.5, True), (0.8, False)):
            pump._last_output = loop.time() - since * HOLD_S
            stream.put(content("b"))
            await settled(lambda: stream.reads)
            assert pump._held(loop) is held
            if pump._hold is not None:
                pump._hold.cancel()
                pump._hold = None
        await pump.aclose()

    run(body())


def test_a_failure_ends_the_wait_for_the_write_interval() -> None:
    async def body() -> None:
        stream = FakeStream()
        pump, _ = make_pump([stream], write_interval_s=HOLD_S)
        await anext(pump)
        stream.put(content("a"))
        await anext(pump)
        stream.put(content("b"), ServiceUnavailableError("worker gone"))
        last = await anext(pump)
        assert deltas(last) == [{"content": "b"}]  # what was read, then the error
        assert "event: error" in last.decode() and frames(last)[-1] == "data: [DONE]"
        await pump.aclose()

    run(body())


def test_heartbeats_while_the_worker_is_silent() -> None:
    async def body() -> None:
        stream = FakeStream()
        pump, _ = make_pump([stream], heartbeat_s=0.02)
        await anext(pump)
        assert await anext(pump) == sse.HEARTBEAT_FRAME
        assert await anext(pump) == sse.HEARTBEAT_FRAME
        stream.put(content("a"))
        assert deltas(await anext(pump)) == [{"content": "a"}]
        await pump.aclose()

    run(body())


def test_idle_timeout_ends_with_an_error_and_cancels_the_call() -> None:
    async def body() -> None:
        stream = FakeStream()
        metrics = FakeMetrics()
        pump, _ = make_pump([stream], idle_s=0.05, metrics=metrics)
        stream.put(content("a"))
        writes = await drain_pump(pump)
        tail = frames(writes[-1])
        assert tail[-2].startswith("event: error\n") and '"stream_idle_timeout"' in tail[-2]
        assert tail[-1] == "data: [DONE]"
        assert stream.cancelled
        assert ("error", ("stream_idle_timeout", "stream_idle_timeout")) in metrics.calls
        assert metrics.calls[-1] == ("closed", False)  # ended by us, not a disconnect

    run(body())


def test_total_deadline_cuts_a_stream_that_keeps_talking() -> None:
    async def body() -> None:
        stream = FakeStream()
        pump, _ = make_pump([stream], total_s=0.1)

        async def talk() -> None:
            while True:
                stream.put(content("x"))
                await asyncio.sleep(0.005)

        talker = asyncio.create_task(talk())
        writes = await drain_pump(pump)
        talker.cancel()
        assert '"timeout_error"' in frames(writes[-1])[-2] and stream.cancelled

    run(body())


def test_stop_sends_what_was_read_then_the_error() -> None:
    async def body() -> None:
        stream = FakeStream()
        drain = FakeDrain()
        pump, _ = make_pump([stream], drain=drain)
        await anext(pump)
        assert drain.registered == {pump}
        stream.put(content("a"))
        assert await settled(lambda: stream.reads) == 1  # read, not yet written
        pump.stop(ServerShuttingDownError("bye", code="server_shutting_down"))
        assert stream.cancelled
        writes = await drain_pump(pump)
        assert deltas(writes[0]) == [{"content": "a"}]
        assert '"server_shutting_down"' in frames(writes[0])[-2]
        assert not drain.registered

    run(body())


def test_a_call_failure_after_some_events_ends_with_its_error() -> None:
    async def body() -> None:
        stream = FakeStream()
        stream.put(content("a"), ServiceUnavailableError("worker died", code="worker_unavailable"))
        writes = await drain_pump(make_pump([stream])[0])
        tail = frames(b"".join(writes))
        assert deltas(b"".join(writes))[-1] == {"content": "a"}
        assert json.loads(tail[-2].split("data: ", 1)[1])["error"]["code"] == "worker_unavailable"

    run(body())


def test_a_failure_of_one_of_several_calls_cancels_the_others() -> None:
    async def body() -> None:
        calls = [FakeStream(), FakeStream()]
        calls[1].put(ServiceUnavailableError("gone"))
        writes = await drain_pump(make_pump(calls)[0])
        assert "event: error" in b"".join(writes).decode()
        assert all(call.cancelled for call in calls)

    run(body())


def test_closing_early_is_a_disconnect_and_cancels_every_call() -> None:
    async def body() -> None:
        calls = [FakeStream(), FakeStream()]
        metrics = FakeMetrics()
        pump, _ = make_pump(calls, metrics=metrics)
        await anext(pump)
        waiting = asyncio.ensure_future(anext(pump))  # waits for the workers
        await asyncio.sleep(0.01)
        waiting.cancel()  # the client went away: Quart cancels the step, then closes the body
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await pump.aclose()
        assert all(call.cancelled for call in calls)
        assert metrics.calls[-1] == ("closed", True)

    run(body())


def test_a_surface_brings_its_own_framing() -> None:
    def encode(chunk: dict[str, Any]) -> bytes:
        return f"event: {'role' if 'role' in str(chunk) else 'delta'}\ndata: {sse.dumps(chunk)}\n\n".encode()

    def error(failure: EdgeError) -> bytes:
        return b"event: failure\ndata: " + sse.dumps({"type": failure.type}).encode() + b"\n\n"

    framing = StreamFraming(
        encode=encode, heartbeat=b"event: ping\ndata: {}\n\n", end=b"", error=error, surface="anthropic"
    )
    metrics = FakeMetrics()

    async def body() -> None:
        stream = FakeStream()
        pump, _ = make_pump([stream], framing=framing, heartbeat_s=0.02, metrics=metrics)
        assert frames(await anext(pump))[0].startswith("event: role\n")
        assert await anext(pump) == b"event: ping\ndata: {}\n\n"
        stream.put(content("a"), ServiceUnavailableError("gone"))
        tail = frames(b"".join([w async for w in pump]))
        assert tail[0].startswith("event: delta\n") and tail[-1].startswith("event: failure\n")
        await pump.aclose()

    run(body())
    assert metrics.surfaces == {"anthropic"}  # the stream's metrics carry its surface
