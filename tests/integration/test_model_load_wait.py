"""Requests that reach the edge while its only worker is still loading its model.

Real processes: two edges start first (one waits for a load, one has
``--wait-for-load-seconds 0``), then a fake-token worker whose model load takes
``--fake-load-seconds``. Once the edges see the worker as LOADING, the native
stream shows ``model_load.*`` events and then a normal chat; an OpenAI request
(official SDK) waits silently and gets its normal answer; the edge that does
not wait answers 503 as before.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice.status import read_details
from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from tests.processes import LiveEdgeProcess, WorkerProcess

pytestmark = pytest.mark.integration

# Long enough that both requests surely arrive during the load on a busy 2-core machine (they went
# out 0.3 s after the worker's launch on a loaded one); the edges notice the loading worker within
# about a second (--health-interval 1). A request sent after the load fails the test (its events
# start with chat.start, not model_load.start); the test waits the load out either way.
LOAD_SECONDS = 6


def grpc_answers(address: str) -> bool:
    """Whether the worker's gRPC server answers health checks yet (with any status)."""
    try:
        with grpc.insecure_channel(address) as channel:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
            return True
    except grpc.RpcError:
        return False


def worker_states(edge: LiveEdgeProcess) -> list[dict[str, Any]]:
    reply = httpx.get(f"{edge.base_url}/ready", timeout=5)
    return list(reply.json()["workers"])


def wait_until(condition: Any, what: str, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting until {what}")


async def native_stream(base_url: str) -> list[tuple[str, dict[str, Any]]]:
    """The named events of one streamed ``/api/v1/chat``."""
    body = {
        "model": "SmolLM2-135M-Instruct",
        "input": "Tell me about the town.",
        "stream": True,
        "max_output_tokens": 8,
    }
    events: list[tuple[str, dict[str, Any]]] = []
    async with (
        httpx.AsyncClient(timeout=120) as client,
        client.stream("POST", f"{base_url}/api/v1/chat", json=body) as response,
    ):
        assert response.status_code == 200
        name = ""
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: ") :])))
    return events


async def openai_chat(base_url: str) -> str | None:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    completion = await client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Tell me about the town."}],
        max_tokens=8,
    )
    return completion.choices[0].message.content


@pytest.fixture()
def loading_setup(
    model_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[WorkerProcess, LiveEdgeProcess, LiveEdgeProcess]]:
    worker = WorkerProcess(
        cache_dir=model_cache,
        log_dir=tmp_path_factory.mktemp("loading-worker-log"),
        extra=["--fake-tokens", "--fake-load-seconds", str(LOAD_SECONDS)],
    )
    fast = ["--health-interval", "1"]
    waiting = LiveEdgeProcess([worker.address], log_dir=tmp_path_factory.mktemp("edge-log"), extra=fast)
    impatient = LiveEdgeProcess(
        [worker.address],
        log_dir=tmp_path_factory.mktemp("edge-nowait-log"),
        extra=[*fast, "--wait-for-load-seconds", "0"],
    )
    with waiting, impatient:
        worker.launch()  # not started(): that would wait until it serves
        try:
            yield worker, waiting, impatient
        finally:
            worker.stop()


def test_requests_during_the_model_load_wait_and_see_it(
    loading_setup: tuple[WorkerProcess, LiveEdgeProcess, LiveEdgeProcess],
) -> None:
    worker, waiting, impatient = loading_setup
    wait_until(lambda: grpc_answers(worker.address), "the worker's gRPC server answers")
    for edge in (waiting, impatient):
        wait_until(lambda edge=edge: worker_states(edge)[0]["status"] == "LOADING", "the edge sees LOADING")
    state = worker_states(waiting)[0]
    assert 0.0 <= state["load_fraction"] < 1.0

    # Over gRPC: a call that does not wait fails at once, saying how far the load has come;
    # a bad wait is named.
    with grpc.insecure_channel(worker.address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        request = pb.GenerateRequest(
            chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="Hi")]),
            sampling=pb.SamplingParams(max_tokens=2),
        )
        with pytest.raises(grpc.RpcError) as refused_call:
            list(stub.Generate(request, timeout=30))
        details = read_details(refused_call.value)
        assert (details.code, details.reason) == (grpc.StatusCode.UNAVAILABLE, "model_loading")
        assert details.load_fraction is not None and 0.0 <= details.load_fraction < 1.0
        request.model_load_wait_seconds = -1
        with pytest.raises(grpc.RpcError) as bad_call:
            list(stub.Generate(request, timeout=30))
        assert bad_call.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert read_details(bad_call.value).param == "model_load_wait_seconds"

    # The edge that does not wait answers as it always did.
    refused = httpx.post(
        f"{impatient.base_url}/api/v1/chat",
        json={"model": "SmolLM2-135M-Instruct", "input": "Hi"},
        timeout=30,
    )
    assert refused.status_code == 503
    assert refused.headers.get("Retry-After")

    async def both() -> tuple[list[tuple[str, dict[str, Any]]], str | None]:
        return await asyncio.gather(native_stream(waiting.base_url), openai_chat(waiting.base_url))

    events, answer = asyncio.run(both())
    assert worker.ready()  # both ended after the load

    names = [name for name, _ in events]
    assert names[0] == "model_load.start"
    end = names.index("model_load.end")
    assert set(names[1:end]) == {"model_load.progress"} and end >= 2
    fractions = [data["progress"] for name, data in events if name == "model_load.progress"]
    assert fractions == sorted(fractions) and all(0.0 <= f <= 1.0 for f in fractions)
    assert names[end + 1 : end + 3] == ["chat.start", "prompt_processing.start"]
    assert names[-1] == "chat.end" and "message.delta" in names and "error" not in names
    assert all(name == data["type"] for name, data in events)
    result = events[-1][1]["result"]
    assert result["model_instance_id"] == "SmolLM2-135M-Instruct"
    assert result["stats"]["total_output_tokens"] == 8

    # The OpenAI surface waited silently and answered normally.
    assert answer
