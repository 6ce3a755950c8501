"""sluice.client against a scripted in-process grpc.aio worker: events, errors, deadlines, cancellation."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from edge.errors import RateLimitError, from_grpc
from sluice.client import CHANNEL_OPTIONS, ServingStatus, WorkerCallError, WorkerClient
from sluice.status import ErrorDetails, read_details
from sluice.v1 import worker_pb2
from tests.unit.edge.edge_fakes import (
    Abort,
    FakeWorker,
    Hang,
    Step,
    content,
    dead_address,
    finished,
    run,
    running_worker,
    started,
    usage,
)

REQUEST = worker_pb2.GenerateRequest(
    chat=worker_pb2.ChatInput(messages=[worker_pb2.ChatMessage(role="user", content="Hi")])
)
HAPPY: list[Step] = [started(), content("Hel"), content("lo"), finished(), usage()]
QUEUE_FULL = ErrorDetails(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue is full", "queue_full", None, 2.5)


def kinds(events: list[worker_pb2.GenerateResponse]) -> list[str | None]:
    return [e.WhichOneof("event") for e in events]


def test_generate_streams_every_event_then_ends() -> None:
    fake = FakeWorker(script=HAPPY)

    async def body() -> None:
        async with running_worker(fake) as address, WorkerClient(address) as client:
            events = [e async for e in client.generate(REQUEST, timeout=5, metadata=[("x-request-id", "r1")])]
            assert kinds(events) == ["started", "content", "content", "finished", "usage"]
            assert fake.metadata[0]["x-request-id"] == "r1"
            call = client.generate(REQUEST, timeout=5)
            assert [await call.read() for _ in range(5)] == events
            assert await call.read() is None and call.done()

    run(body())


def test_list_models_and_health() -> None:
    fake = FakeWorker(worker_id="w-7", models=["m-1"])

    async def body() -> None:
        async with running_worker(fake) as address, WorkerClient(address) as client:
            listing = await client.list_models(timeout=5)
            assert listing.worker_id == "w-7" and [m.id for m in listing.models] == ["m-1"]
            assert await client.health() is ServingStatus.SERVING
            assert await client.health("") is ServingStatus.SERVING
            with pytest.raises(WorkerCallError) as caught:
                await client.health("no.such.Service")
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        async with running_worker(fake, serving=False) as address, WorkerClient(address) as client:
            assert await client.health() is ServingStatus.NOT_SERVING

    run(body())


def test_error_before_first_event_is_typed_with_details() -> None:
    fake = FakeWorker(script=[Abort(QUEUE_FULL)])

    async def body() -> None:
        async with running_worker(fake) as address, WorkerClient(address) as client:
            with pytest.raises(WorkerCallError) as caught:
                async for _ in client.generate(REQUEST, timeout=5):
                    pass
        error = caught.value
        assert isinstance(error, grpc.RpcError)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and error.details() == "queue is full"
        assert (error.message, error.reason, error.retry_after_seconds) == (
            "queue is full",
            "queue_full",
            2.5,
        )
        # Code written for grpc's own errors reads it unchanged.
        assert read_details(error) == error.status
        assert isinstance(from_grpc(error), RateLimitError)

    run(body())


def test_error_after_some_events() -> None:
    bad = ErrorDetails(
        grpc.StatusCode.INVALID_ARGUMENT, "bad temperature", "invalid_parameter", "temperature"
    )
    fake = FakeWorker(script=[started(), content("x"), Abort(bad)])

    async def body() -> None:
        seen: list[worker_pb2.GenerateResponse] = []
        async with running_worker(fake) as address, WorkerClient(address) as client:
            with pytest.raises(WorkerCallError) as caught:
                async for event in client.generate(REQUEST, timeout=5):
                    seen.append(event)
        assert kinds(seen) == ["started", "content"]
        assert caught.value.param == "temperature" and caught.value.reason == "invalid_parameter"

    run(body())


def test_break_out_of_async_for_cancels_the_call() -> None:
    fake = FakeWorker(script=[started(), content("a"), Hang()])

    async def body() -> None:
        async with running_worker(fake) as address, WorkerClient(address) as client:
            async for event in client.generate(REQUEST, timeout=30):
                if event.WhichOneof("event") == "content":
                    break
            # No reference to the call is left: it is cancelled at once.
            await asyncio.wait_for(fake.cancelled.wait(), 5)

    run(body())


@pytest.mark.parametrize("how", ["async_with", "aclose", "cancel"])
def test_explicit_stop_cancels_the_call(how: str) -> None:
    fake = FakeWorker(script=[started(), Hang()])

    async def body() -> None:
        async with running_worker(fake) as address, WorkerClient(address) as client:
            call = client.generate(REQUEST, timeout=30)
            if how == "async_with":
                async with call:
                    assert (await call.read()) is not None
            else:
                assert (await call.read()) is not None
                await call.aclose() if how == "aclose" else call.cancel()
            await asyncio.wait_for(fake.cancelled.wait(), 5)
            # Reading a call this side cancelled is a typed CANCELLED, not a CancelledError.
            with pytest.raises(WorkerCallError) as caught:
                await call.read()
            assert caught.value.code() == grpc.StatusCode.CANCELLED
            del call

    run(body())


def test_cancelled_reader_cancels_the_call_and_stays_cancelled() -> None:
    fake = FakeWorker(script=[started(), Hang()])

    async def body() -> None:
        async with running_worker(fake) as address, WorkerClient(address) as client:
            call = client.generate(REQUEST, timeout=30)

            async def consume() -> None:
                async for _ in call:
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(fake.cancelled.wait(), 5)
            assert call.done()

    run(body())


def test_deadline_is_the_grpc_timeout() -> None:
    fake = FakeWorker(script=[started(), Hang()])

    async def body() -> None:
        async with running_worker(fake) as address, WorkerClient(address) as client:
            with pytest.raises(WorkerCallError) as caught:
                async for _ in client.generate(REQUEST, timeout=0.3):
                    pass
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.wait_for(fake.cancelled.wait(), 5)  # the worker saw the deadline too

    run(body())


def test_unreachable_worker_is_unavailable_fast() -> None:
    async def body() -> None:
        async with WorkerClient(dead_address()) as client:
            start = asyncio.get_running_loop().time()
            with pytest.raises(WorkerCallError) as caught:
                await client.health(timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and caught.value.reason == ""
            with pytest.raises(WorkerCallError) as caught:
                await client.generate(REQUEST, timeout=5).read()
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert asyncio.get_running_loop().time() - start < 4  # refused, not timed out

    run(body())


def test_bad_arguments_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="address"):
        WorkerClient(" ")

    async def body() -> None:
        client = WorkerClient("127.0.0.1:1")
        with pytest.raises(ValueError, match="timeout"):
            client.generate(REQUEST, timeout=0)
        await client.close()
        await client.close()  # idempotent

    run(body())


def test_recommended_channel_options() -> None:
    options = dict(CHANNEL_OPTIONS)
    for key in (
        "grpc.keepalive_time_ms",
        "grpc.keepalive_timeout_ms",
        "grpc.keepalive_permit_without_calls",
        "grpc.http2.max_pings_without_data",
        "grpc.max_send_message_length",
        "grpc.max_receive_message_length",
    ):
        assert key in options
    # The worker must accept the client's pings (see worker/server.py): its minimum ping
    # interval is below the client's keepalive time.
    from worker.service.grpc_server import SERVER_OPTIONS

    server = dict(SERVER_OPTIONS)
    assert server["grpc.http2.min_ping_interval_without_data_ms"] < options["grpc.keepalive_time_ms"]
    assert server["grpc.keepalive_permit_without_calls"] == 1
    assert server["grpc.max_receive_message_length"] == options["grpc.max_send_message_length"]


def test_docs_show_the_example_program_verbatim() -> None:
    from tests.processes import REPO_ROOT

    example = (REPO_ROOT / "docs" / "examples" / "client_example.py").read_text()
    assert f"```python\n{example}```" in (REPO_ROOT / "docs" / "grpc.md").read_text()


def test_a_fresh_channel_does_not_inherit_the_old_ones_reconnect_backoff() -> None:
    """What the edge's pool relies on to take a restarted worker back at once (issue 17)."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from tests.unit.edge.edge_fakes import free_port

    # A backoff of a minute: the old channel cannot retry during this test.
    slow = {
        **dict(CHANNEL_OPTIONS),
        "grpc.initial_reconnect_backoff_ms": 60_000,
        "grpc.min_reconnect_backoff_ms": 60_000,
        "grpc.max_reconnect_backoff_ms": 60_000,
    }
    address = f"127.0.0.1:{free_port()}"

    async def body() -> None:
        old = WorkerClient(address, options=tuple(slow.items()))
        with pytest.raises(WorkerCallError) as refused:
            await old.health(timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert old.backing_off()
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        server.add_insecure_port(address)
        await server.start()
        try:
            # The worker is back, but the old channel waits out its backoff...
            with pytest.raises(WorkerCallError):
                await old.health("", timeout=5)
            assert old.backing_off()
            # ...while a fresh channel to the same address, same settings, connects at once.
            async with WorkerClient(address, options=tuple(slow.items())) as fresh:
                assert not fresh.backing_off()
                assert await fresh.health("", timeout=5) == ServingStatus.SERVING
            await old.close()
            assert not old.backing_off()
            assert await old.health("", timeout=5) == ServingStatus.SERVING  # reopened fresh
        finally:
            await old.close()
            await server.stop(None)

    run(body())
