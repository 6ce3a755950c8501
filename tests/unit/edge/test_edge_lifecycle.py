"""Slow clients and graceful drain, with the edge served by hypercorn in-process against a fake worker.

The same behaviours are tested against real processes in
tests/integration/test_edge_streams.py and tests/integration/test_edge_drain.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc
import httpx
import pytest
from edge_fakes import (
    CHAT_BODY,
    FakeWorker,
    Hang,
    Step,
    content,
    finished,
    free_port,
    raw_request,
    run,
    running_edge,
    running_worker,
    started,
    usage,
    wait_for,
)

from edge.__main__ import serve_edge
from edge.settings import Settings
from edge.streaming.connections import transport_of
from sluice.v1 import worker_pb2

STREAM_BODY = {**CHAT_BODY, "stream": True}
HAPPY: list[Step] = [started(), content("Hel"), content("lo"), finished(), usage()]
# A worker that streams as fast as the client takes it: 4 KB per event, far more than any socket buffer.
FLOOD: list[Step] = [started(), *(content("x" * 4000) for _ in range(5000)), finished(), usage()]


class CountingWorker(FakeWorker):
    """Counts the events it managed to send (a cancelled call stops being written to)."""

    sent = 0

    async def Generate(  # gRPC method name
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        async for event in super().Generate(request, context):
            self.sent += 1
            yield event


def by_user(scripts: dict[str, list[Step]]) -> CountingWorker:
    return CountingWorker(script_for=lambda request: scripts[request.user or "happy"])


async def no_call_outstanding(client: httpx.AsyncClient, base: str) -> bool:
    ready = (await client.get(f"{base}/ready")).json()
    return all(worker["outstanding"] == 0 for worker in ready["workers"])


def test_transport_of_finds_nothing_in_a_plain_callable() -> None:
    async def send(message: Any) -> None:
        return None

    assert transport_of(send) is None
    assert transport_of(print) is None


# The transports of the two loops differ (uvloop's do not derive from asyncio.WriteTransport), and
# finding the client's transport is what the write timeout and the final abort rest on.
BOTH_LOOPS = pytest.mark.parametrize("loop", ["asyncio", "uvloop"])


@BOTH_LOOPS
def test_a_client_that_stops_reading_is_disconnected_and_its_call_cancelled(
    caplog: pytest.LogCaptureFixture, loop: str
) -> None:
    fake = by_user({"flood": FLOOD, "happy": HAPPY})

    async def body() -> None:
        async with running_worker(fake) as address, running_edge([address], write_timeout_s=0.5) as base:
            port = int(base.rsplit(":", 1)[1])
            stalled = socket.socket()
            stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
            stalled.setblocking(False)
            loop = asyncio.get_running_loop()
            await loop.sock_connect(stalled, ("127.0.0.1", port))
            await loop.sock_sendall(stalled, raw_request({**STREAM_BODY, "user": "flood"}))
            began = time.monotonic()
            # Meanwhile another client streams to completion, unaffected.
            async with httpx.AsyncClient(timeout=10) as client:
                normal = await client.post(f"{base}/v1/chat/completions", json=STREAM_BODY)
            assert normal.status_code == 200 and normal.text.endswith("data: [DONE]\n\n")
            async with httpx.AsyncClient(timeout=10) as client:
                await wait_for(lambda: no_call_outstanding(client, base), within_s=10)
            print(f"flood call cancelled {time.monotonic() - began:.2f} s after the request")
            sent = fake.sent
            await asyncio.sleep(0.3)
            assert fake.sent == sent < len(FLOOD)  # the worker stopped sending: its call is gone
            # The edge closed the connection: reading now ends (reset or EOF) instead of blocking.
            received = 0
            with contextlib.suppress(ConnectionResetError):
                while chunk := await asyncio.wait_for(loop.sock_recv(stalled, 65536), 5):
                    received += len(chunk)
            stalled.close()
            assert received < 4000 * 5000  # far from the whole answer

    with caplog.at_level(logging.WARNING, logger="sluice.edge"):
        run(body(), loop=loop)
    assert any("accepted no response bytes" in r.getMessage() for r in caplog.records)


@contextlib.asynccontextmanager
async def draining_edge(
    workers: list[str], **overrides: Any
) -> AsyncIterator[tuple[str, asyncio.Event, asyncio.Task[None]]]:
    """The edge served with a drain trigger; yields (base URL, drain event, serving task)."""
    settings = replace(Settings(workers=tuple(workers)), port=free_port(), **overrides)
    stop, drain = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(serve_edge(settings, stop, drain))
    base = f"http://127.0.0.1:{settings.port}"
    async with httpx.AsyncClient() as client:

        async def up() -> bool:
            with contextlib.suppress(httpx.TransportError):
                return (await client.get(f"{base}/health")).status_code == 200
            return False

        await wait_for(up)
    try:
        yield base, drain, task
    finally:
        stop.set()
        await task


def test_drain_refuses_new_work_then_ends_open_streams_cleanly() -> None:
    fake = by_user({"long": [started(), content("Hel"), Hang()], "happy": HAPPY})

    async def body() -> None:
        async with (
            running_worker(fake) as address,
            draining_edge([address], drain_delay_s=0.6, graceful_timeout_s=0.6) as (base, drain, task),
            httpx.AsyncClient(timeout=10) as client,
        ):
            assert (await client.get(f"{base}/ready")).status_code == 200
            async with client.stream(
                "POST", f"{base}/v1/chat/completions", json={**STREAM_BODY, "user": "long"}
            ) as stream:
                pieces = stream.aiter_raw()
                seen = b""
                while b'"Hel"' not in seen:
                    seen += await anext(pieces)
                began = time.monotonic()
                drain.set()
                await asyncio.sleep(0.05)
                async with httpx.AsyncClient(timeout=5) as other:  # a fresh connection
                    ready = await other.get(f"{base}/ready")
                    assert ready.status_code == 503
                    assert ready.json()["error"]["code"] == "server_shutting_down"
                    refused = await other.post(f"{base}/v1/chat/completions", json=STREAM_BODY)
                    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
                    assert refused.json()["error"]["code"] == "server_shutting_down"
                    assert refused.headers["connection"] == "close"
                async for piece in pieces:
                    seen += piece
            ended = time.monotonic() - began
            frames = seen.decode().removesuffix("\n\n").split("\n\n")
            assert frames[-1] == "data: [DONE]"
            event_line, data_line = frames[-2].split("\n")
            error = json.loads(data_line.removeprefix("data: "))["error"]
            assert event_line == "event: error" and error["code"] == "server_shutting_down"
            print(f"stream ended {ended:.2f} s after the drain began")
            assert 1.0 < ended < 5.0  # drain delay + grace, then at once
            await asyncio.wait_for(fake.cancelled.wait(), 5)
            await asyncio.wait_for(task, 5)  # hypercorn returned: the edge is down
            with pytest.raises(httpx.ConnectError):
                await client.get(f"{base}/health")
            assert fake.calls_started == 1  # the refused request never reached the worker

    run(body())


def test_progress_stage_names_match_the_contract() -> None:
    # The guard treats every worker event alike; progress must stay a GenerateResponse event kind.
    event = worker_pb2.GenerateResponse(progress=worker_pb2.Progress(stage=worker_pb2.Progress.QUEUED))
    assert event.WhichOneof("event") == "progress"


@BOTH_LOOPS
def test_shutdown_is_not_held_up_by_a_client_that_does_not_read(loop: str) -> None:
    # Without the final abort, hypercorn waits forever to flush the stalled connection.
    fake = by_user({"flood": FLOOD})

    async def body() -> None:
        async with running_worker(fake) as address:
            overrides = {"drain_delay_s": 0.2, "graceful_timeout_s": 0.3, "write_timeout_s": 100.0}
            async with draining_edge([address], **overrides) as (base, drain, task):
                port = int(base.rsplit(":", 1)[1])
                stalled = socket.socket()
                stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                stalled.setblocking(False)
                loop = asyncio.get_running_loop()
                await loop.sock_connect(stalled, ("127.0.0.1", port))
                await loop.sock_sendall(stalled, raw_request({**STREAM_BODY, "user": "flood"}))
                await wait_for(lambda: fake.sent > 10)
                began = time.monotonic()
                drain.set()
                await asyncio.wait_for(task, 10)
                print(f"edge stopped {time.monotonic() - began:.2f} s after the drain began")
                stalled.close()

    run(body(), loop=loop)
