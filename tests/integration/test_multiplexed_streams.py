"""GenerateStreams against one real ``--fake-tokens`` worker (and an edge in front of it): the
client learns from ListModels that the worker serves it, concurrent streams get exactly their own
events, a cancelled or expired stream leaves the worker, a reader that stops reading holds up no
other stream and later gets its deltas merged, a refused request fails alone; the same streams from
an engine in its own process, and its death. A worker dying under multiplexed streams is
tests/integration/test_stream_migration.py's (its edge uses GenerateStreams)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from sluice.client import WorkerCallError, WorkerClient
from sluice.streams import WINDOW, EventCall, StreamCall
from sluice.v1 import worker_pb2 as pb
from tests.processes import EdgeProcess, WorkerProcess
from worker.model.fake_runner import PASSAGE

pytestmark = pytest.mark.integration

LONG = 2000  # tokens: far longer than any test waits for (2 ms a step)


@pytest.fixture(scope="module")
def worker(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    extra = ["--fake-tokens", "--fake-step-ms", "2", "--max-running", "64"]
    log_dir = tmp_path_factory.mktemp("mux-worker")
    with WorkerProcess(cache_dir=model_cache, log_dir=log_dir, extra=extra) as process:
        yield process


@pytest.fixture(scope="module")
def edge(worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeProcess]:
    with EdgeProcess(
        [worker.address], log_dir=tmp_path_factory.mktemp("mux-edge"), extra=["--multiplexed-streams"]
    ) as process:
        yield process


def request(max_tokens: int, request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt=pb.PromptInput(text="Tell me about the town."),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        return_token_ids=True,
    )


async def read_all(call: EventCall) -> list[pb.GenerateResponse]:
    events = []
    while (event := await call.read()) is not None:
        events.append(event)
    return events


def in_client(worker: WorkerProcess, body: Callable[[WorkerClient], Awaitable[None]]) -> None:
    async def run() -> None:
        async with WorkerClient(worker.address) as client:
            await body(client)

    asyncio.run(run())


async def logged(worker: WorkerProcess, text: str, within_s: float = 20.0) -> None:
    """Waits until the worker's log has a line with ``text`` (the servicer logs each request's end)."""
    end = time.monotonic() + within_s
    while text not in await asyncio.to_thread(worker.log_tail, 2000):
        assert time.monotonic() < end, f"the worker never logged {text!r}"
        await asyncio.sleep(0.02)


def test_concurrent_streams_each_get_exactly_their_own_events(worker: WorkerProcess) -> None:
    async def body(client: WorkerClient) -> None:
        calls = [client.open_stream(request(8 + i, f"mux-{i}"), timeout=60) for i in range(48)]
        assert all(isinstance(call, StreamCall) for call in calls)
        results = await asyncio.gather(*(read_all(call) for call in calls))
        for i, (call, events) in enumerate(zip(calls, results, strict=True)):
            assert isinstance(call, StreamCall) and call.multiplexed  # by GenerateStreams, not Generate
            kinds = [e.WhichOneof("event") for e in events]
            assert kinds[0] == "started" and kinds[-2:] == ["finished", "usage"]
            assert events[0].started.request_id == f"mux-{i}"
            ids = [t for e in events if e.HasField("content") for t in e.content.token_ids]
            text = "".join(e.content.text for e in events if e.HasField("content"))
            assert len(ids) == events[-2].finished.completion_tokens == 8 + i
            assert PASSAGE.startswith(text)

    in_client(worker, body)


def test_the_client_learns_that_the_worker_serves_generate_streams_before_using_it(
    worker: WorkerProcess,
) -> None:
    async def body(client: WorkerClient) -> None:
        assert (await client.list_models(timeout=10)).generate_streams
        call = client.open_stream(request(4, "mux-probe"), timeout=60)
        assert len(await read_all(call)) > 2
        assert isinstance(call, StreamCall) and call.multiplexed  # not sent as Generate

    in_client(worker, body)


def test_a_cancelled_stream_leaves_the_worker(worker: WorkerProcess) -> None:
    async def body(client: WorkerClient) -> None:
        call = client.open_stream(request(LONG, "mux-cancel"), timeout=60)
        while not (await call.read()).HasField("content"):  # type: ignore[union-attr]
            pass
        call.cancel()
        await logged(worker, "request mux-cancel cancelled by the caller")  # long before its 2000 tokens

    in_client(worker, body)


def test_a_stream_past_its_deadline_fails_and_leaves_the_worker(worker: WorkerProcess) -> None:
    async def body(client: WorkerClient) -> None:
        call = client.open_stream(request(LONG, "mux-deadline"), timeout=0.5)
        with pytest.raises(WorkerCallError) as failure:
            await read_all(call)
        assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await logged(worker, "request mux-deadline cancelled by the caller")

    in_client(worker, body)


def test_a_stalled_reader_holds_up_no_other_stream_and_gets_its_deltas_merged(worker: WorkerProcess) -> None:
    async def body(client: WorkerClient) -> None:
        stalled = client.open_stream(request(400), timeout=60)
        assert (await stalled.read()).HasField("started")  # type: ignore[union-attr]  # then not read
        other = await read_all(client.open_stream(request(60), timeout=60))
        assert other[-2].finished.completion_tokens == 60  # its 60 steps ran while nobody read the first
        contents = [e for e in await read_all(stalled) if e.HasField("content")]
        assert sum(len(e.content.token_ids) for e in contents) == 400  # nothing lost
        # At most a window of those steps was sent as they came (and one held); the rest waited, merged.
        assert len(contents) <= 400 - 60 + WINDOW + 2

    in_client(worker, body)


def test_a_refused_request_fails_alone(worker: WorkerProcess) -> None:
    async def body(client: WorkerClient) -> None:
        good = client.open_stream(request(20), timeout=60)
        bad = client.open_stream(request(10**7), timeout=60)  # beyond the context
        with pytest.raises(WorkerCallError) as failure:
            await read_all(bad)
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT and failure.value.param
        assert (await read_all(good))[-2].finished.completion_tokens == 20

    in_client(worker, body)


def test_streams_through_the_edge_each_get_their_tokens(edge: EdgeProcess) -> None:
    async def one(client: httpx.AsyncClient, max_tokens: int) -> tuple[str, int]:
        body = {
            "model": "SmolLM2-135M-Instruct",
            "prompt": "Tell me about the town.",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        text, tokens = "", -1
        async with client.stream("POST", f"{edge.base_url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                text += "".join(choice["text"] for choice in chunk["choices"])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        return text, tokens

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            results = await asyncio.gather(*(one(client, 10 + i) for i in range(16)))
        for i, (text, tokens) in enumerate(results):
            assert tokens == 10 + i and PASSAGE.startswith(text) and text

    asyncio.run(run())


def test_streams_of_an_engine_in_its_own_process_and_its_death(model_cache: Path, tmp_path: Path) -> None:
    """``--engine-process``: the steps' outputs reach the streams from the pipe's reader; every stream
    gets its own tokens, and when the engine process dies the streams still open fail at once."""
    extra = ["--engine-process", "--fake-tokens", "--fake-step-ms", "2", "--max-running", "16"]
    with WorkerProcess(cache_dir=model_cache, log_dir=tmp_path, extra=extra) as engine_worker:

        async def body(client: WorkerClient) -> None:
            calls = [client.open_stream(request(8 + i, f"mux-ep-{i}"), timeout=60) for i in range(12)]
            for i, events in enumerate(await asyncio.gather(*(read_all(call) for call in calls))):
                ids = [t for e in events if e.HasField("content") for t in e.content.token_ids]
                assert events[0].started.request_id == f"mux-ep-{i}" and len(ids) == 8 + i
            open_ = [client.open_stream(request(LONG), timeout=60) for _ in range(3)]
            for call in open_:
                while not (await call.read()).HasField("content"):  # type: ignore[union-attr]
                    pass
            pid = next(
                int(line.rsplit("pid ", 1)[1].rstrip(")"))
                for line in engine_worker.log_tail(400).splitlines()
                if "the engine runs in its own process (pid " in line
            )
            os.kill(pid, signal.SIGKILL)
            for call in open_:
                with pytest.raises(WorkerCallError) as failure:
                    await asyncio.wait_for(read_all(call), 30)
                assert failure.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)

        in_client(engine_worker, body)
        assert engine_worker.wait_exit(30) == 3
