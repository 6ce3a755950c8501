"""The edge's stream lifecycle against a real worker process and a real edge process.

Progress events from the engine, the idle timeout and the total deadline,
a client that stops reading (the write timeout), and client disconnects
(mid-stream and while queued) freeing the worker, all checked in the worker's
own /metrics counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.integration

WRITE_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def worker(
    model_cache: Path,
    long_tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[WorkerProcess]:
    """Two sequences at a time, so a third request waits in the queue. No model (``--fake-tokens``,
    5 ms a step): the edge's stream lifecycle does not depend on what streams, and a stream of
    4000 tokens lasts 20 s on a slept step rather than computing all the while. The stalled client
    is cut once the edge's socket buffers (megabytes) are full, so the step sets how long it takes:
    17 s at 10 ms a step."""
    extra = ["--max-running", "2", "--fake-tokens", "--fake-step-ms", "5"]
    log_dir = tmp_path_factory.mktemp("streams-worker")
    model = str(long_tiny_model_dir)
    with WorkerProcess(cache_dir=model_cache, log_dir=log_dir, model=model, extra=extra) as process:
        yield process


@pytest.fixture(scope="module")
def edge(worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeProcess]:
    extra = ["--write-timeout", str(WRITE_TIMEOUT_S), "--heartbeat-interval", "0.5"]
    with EdgeProcess(
        [worker.address], log_dir=tmp_path_factory.mktemp("streams-edge"), extra=extra
    ) as process:
        yield process


@pytest.fixture(scope="module")
def model(edge: EdgeProcess) -> str:
    model_id: str = httpx.get(f"{edge.base_url}/v1/models").json()["data"][0]["id"]
    return model_id


def long_body(model: str, **extra: Any) -> dict[str, Any]:
    """A request that runs to the end of the 4096-token context unless it is cut."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Tell a very long story."}],
        "stream": True,
        "max_tokens": 4000,
        "ignore_eos": True,
        "temperature": 0,
        **extra,
    }


async def metrics(worker: WorkerProcess) -> dict[str, float]:
    return await asyncio.to_thread(worker.metrics)


async def settled(worker: WorkerProcess, within_s: float = 10.0) -> tuple[dict[str, float], float]:
    """Waits until the worker runs and queues nothing and holds no cache; returns (metrics, seconds)."""
    began = time.monotonic()
    while True:
        values = await metrics(worker)
        idle = all(
            values[f"sluice_worker_{name}"] == 0
            for name in ("running_requests", "running_sequences", "queue_depth", "live_caches")
        )
        if idle:
            return values, time.monotonic() - began
        assert time.monotonic() - began < within_s, f"worker still busy: {values}"
        await asyncio.sleep(0.02)


async def until(predicate: Any, within_s: float = 10.0) -> None:
    end = time.monotonic() + within_s
    while not await predicate():
        assert time.monotonic() < end, "condition not met in time"
        await asyncio.sleep(0.02)


async def tokens_stay_put(worker: WorkerProcess) -> float:
    """Asserts ``generated_tokens`` no longer grows (nothing is decoding); returns it."""
    before = (await metrics(worker))["sluice_worker_generated_tokens_total"]
    await asyncio.sleep(0.5)
    after = (await metrics(worker))["sluice_worker_generated_tokens_total"]
    assert after == before, "the worker is still generating"
    return after


@contextlib.asynccontextmanager
async def sse_lines(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> AsyncIterator[AsyncIterator[str]]:
    """An open stream's non-empty lines; leaving the block early disconnects."""
    async with client.stream("POST", url, json=body, headers=headers or {}) as response:
        assert response.status_code == 200, await response.aread()

        async def lines() -> AsyncIterator[str]:
            async for line in response.aiter_lines():
                if line:
                    yield line

        yield lines()


async def read_until_content(lines: AsyncIterator[str], count: int) -> None:
    seen = 0
    async for line in lines:
        if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
            seen += 1
            if seen >= count:
                return
    raise AssertionError("the stream ended early")


def error_of(lines: list[str]) -> dict[str, Any]:
    """The error of a stream that ended with ``event: error`` and ``[DONE]``."""
    assert lines[-1] == "data: [DONE]" and lines[-3] == "event: error", lines[-3:]
    error: dict[str, Any] = json.loads(lines[-2].removeprefix("data: "))["error"]
    return error


def test_worker_sends_progress_only_when_asked(worker: WorkerProcess) -> None:
    async def kinds(stream_progress: bool) -> list[str]:
        request = pb.GenerateRequest(
            chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="Hi")]),
            sampling=pb.SamplingParams(max_tokens=3, temperature=0),
            stream_progress=stream_progress,
        )
        async with grpc.aio.insecure_channel(worker.address) as channel:
            events = [e async for e in pb_grpc.WorkerStub(channel).Generate(request)]
        return [e.WhichOneof("event") for e in events]

    asked = asyncio.run(kinds(True))
    assert asked[:3] == ["started", "progress", "progress"] and asked.count("progress") == 2
    assert "progress" not in asked[3:]  # only before the first token
    assert "progress" not in asyncio.run(kinds(False))

    async def stages() -> list[int]:
        request = pb.GenerateRequest(
            chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="Hi")]),
            sampling=pb.SamplingParams(max_tokens=1),
            stream_progress=True,
        )
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stream = pb_grpc.WorkerStub(channel).Generate(request)
            return [e.progress.stage async for e in stream if e.HasField("progress")]

    assert asyncio.run(stages()) == [pb.Progress.QUEUED, pb.Progress.PROMPT_PROCESSING]


def test_a_queued_stream_outlives_its_idle_timeout_on_progress_events(
    worker: WorkerProcess, edge: EdgeProcess, model: str
) -> None:
    url = f"{edge.base_url}/v1/chat/completions"
    short = {**long_body(model), "max_tokens": 5}

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            async with (
                sse_lines(client, url, long_body(model)) as first,
                sse_lines(client, url, long_body(model)) as second,
            ):
                await read_until_content(first, 1)
                await read_until_content(second, 1)  # both slots are busy now
                began = time.monotonic()

                async def queued_stream(idle: str) -> list[str]:
                    async with sse_lines(client, url, short, {"X-Sluice-Idle-Timeout": idle}) as lines:
                        return [line async for line in lines]

                # The worker repeats "queued" every 2 s; 5 s leaves 3 s for a loaded machine's delays.
                patient = asyncio.create_task(queued_stream("5"))
                # The control: an idle timeout below the worker's 2 s "queued" interval is cut.
                impatient = await queued_stream("1")
                assert error_of(impatient)["type"] == "stream_idle_timeout"
                await until(lambda: queued(worker, 1), within_s=5)  # its call left the queue
                await asyncio.sleep(11 - (time.monotonic() - began))  # over 2 idle timeouts in the queue
                assert not patient.done()
            # Both long streams disconnected: the queued request gets a slot and finishes.
            lines = await asyncio.wait_for(patient, 30)
            waited = time.monotonic() - began
            print(f"the queued stream finished after {waited:.1f} s, with a 5 s idle timeout")
            assert lines[-1] == "data: [DONE]" and "event: error" not in lines
            assert any('"finish_reason":"length"' in line for line in lines)
            assert lines.count(": heartbeat") >= 10  # heartbeats went out while it waited
            assert waited > 11
        await settled(worker)

    asyncio.run(scenario())


def test_total_deadline_cancels_the_worker_call(worker: WorkerProcess, edge: EdgeProcess, model: str) -> None:
    url = f"{edge.base_url}/v1/chat/completions"

    async def scenario() -> None:
        before = await metrics(worker)
        async with httpx.AsyncClient(timeout=60) as client:
            began = time.monotonic()
            async with sse_lines(client, url, long_body(model), {"X-Sluice-Timeout": "1.5"}) as lines:
                got = [line async for line in lines]
            elapsed = time.monotonic() - began
            error = error_of(got)
            assert error["type"] == "timeout_error" and error["code"] == "timeout"
            print(f"stream cut by its 1.5 s deadline after {elapsed:.2f} s")
            assert elapsed < 10
            await settled(worker)

            plain = await client.post(
                url, json={**long_body(model), "stream": False}, headers={"X-Sluice-Timeout": "1"}
            )
            assert plain.status_code == 504 and plain.json()["error"]["type"] == "timeout_error"
            values, _ = await settled(worker)
        assert (
            values["sluice_worker_requests_cancelled_total"]
            - before["sluice_worker_requests_cancelled_total"]
            == 2
        )
        await tokens_stay_put(worker)

    asyncio.run(scenario())


def test_a_client_that_stops_reading_is_cut_while_another_streams(
    worker: WorkerProcess, edge: EdgeProcess, model: str
) -> None:
    async def scenario() -> None:
        before = await metrics(worker)
        loop = asyncio.get_running_loop()
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
        stalled.setblocking(False)
        await loop.sock_connect(stalled, ("127.0.0.1", edge.port))
        # logprobs make each chunk about 2 KB, so the buffers fill within a fraction of a second.
        payload = json.dumps(long_body(model, logprobs=True, top_logprobs=20)).encode()
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode()
        await loop.sock_sendall(stalled, head + payload)
        began = time.monotonic()
        async with httpx.AsyncClient(timeout=60) as client:
            await until(lambda: running(worker, 1))
            normal_began = time.monotonic()
            body = {**long_body(model), "max_tokens": 200}
            async with sse_lines(client, f"{edge.base_url}/v1/chat/completions", body) as lines:
                got = [line async for line in lines]
            print(f"a normal stream of 200 tokens took {time.monotonic() - normal_began:.2f} s meanwhile")
            assert got[-1] == "data: [DONE]" and "event: error" not in got
        values, _ = await settled(worker, within_s=30)
        print(f"the stalled client's call was cancelled {time.monotonic() - began:.2f} s after it began")
        cancelled = (
            values["sluice_worker_requests_cancelled_total"]
            - before["sluice_worker_requests_cancelled_total"]
        )
        assert cancelled == 1  # cut, not finished: 4000 tokens take far longer
        await tokens_stay_put(worker)
        # The edge closed that connection: reading now ends (reset or EOF) instead of blocking.
        received = 0
        with contextlib.suppress(ConnectionResetError):
            while chunk := await asyncio.wait_for(loop.sock_recv(stalled, 65536), 5):
                received += len(chunk)
        stalled.close()
        print(f"the stalled client had {received} bytes waiting for it")
        assert "accepted no response bytes" in edge.log_path.read_text()

    asyncio.run(scenario())


async def running(worker: WorkerProcess, count: int) -> bool:
    return (await metrics(worker))["sluice_worker_running_requests"] == count


def test_disconnect_mid_stream_frees_the_sequence(
    worker: WorkerProcess, edge: EdgeProcess, model: str
) -> None:
    async def scenario() -> None:
        before = await metrics(worker)
        async with httpx.AsyncClient(timeout=60) as client:
            async with sse_lines(client, f"{edge.base_url}/v1/chat/completions", long_body(model)) as lines:
                await read_until_content(lines, 20)
                at_disconnect = await metrics(worker)
                assert at_disconnect["sluice_worker_running_sequences"] == 1
                began = time.monotonic()
            values, freed_s = await settled(worker)
        steps = values["sluice_worker_steps_total"] - at_disconnect["sluice_worker_steps_total"]
        print(f"sequence freed {freed_s * 1000:.0f} ms after the disconnect ({steps:.0f} engine steps)")
        assert time.monotonic() - began < 5
        assert (
            values["sluice_worker_requests_cancelled_total"]
            == before["sluice_worker_requests_cancelled_total"] + 1
        )
        assert values["sluice_worker_reserved_tokens"] == 0
        await tokens_stay_put(worker)

    asyncio.run(scenario())


def test_disconnect_before_the_first_token_frees_the_queue_slot(
    worker: WorkerProcess, edge: EdgeProcess, model: str
) -> None:
    url = f"{edge.base_url}/v1/chat/completions"

    async def scenario() -> None:
        before = await metrics(worker)
        async with httpx.AsyncClient(timeout=60) as client:
            async with (
                sse_lines(client, url, long_body(model)) as first,
                sse_lines(client, url, long_body(model)) as second,
            ):
                await read_until_content(first, 1)
                await read_until_content(second, 1)
                async with sse_lines(client, url, long_body(model)):
                    # Headers arrived (the worker accepted the call); it waits in the queue.
                    await until(lambda: queued(worker, 1))
                await until(lambda: queued(worker, 0), within_s=5)  # gone from the queue
                assert await running(worker, 2)  # the others are untouched
            values, _ = await settled(worker)
        assert (
            values["sluice_worker_requests_cancelled_total"]
            == before["sluice_worker_requests_cancelled_total"] + 3
        )
        await tokens_stay_put(worker)

    asyncio.run(scenario())


async def queued(worker: WorkerProcess, count: int) -> bool:
    return (await metrics(worker))["sluice_worker_queue_depth"] == count


def test_the_edge_process_runs_on_uvloop_by_default(edge: EdgeProcess) -> None:
    # Every stream test above ran through this edge: the default loop is uvloop where installed.
    assert "event loop: uvloop" in edge.log_path.read_text()
