"""Fakes for the edge tests: a scripted grpc.aio Worker servicer and a served edge.

No pytest-asyncio: each async test body runs in a loop of its own (see
``run``: asyncio's by default, uvloop where a test asks), so the suite needs
nothing beyond pytest.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

import grpc
import httpx
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from edge import event_loop
from edge.__main__ import serve_edge
from edge.settings import Settings
from sluice.status import ErrorDetails, build_status
from sluice.v1 import worker_pb2, worker_pb2_grpc

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], timeout: float = 20.0, *, loop: str = "asyncio") -> T:
    """Runs one async test body in a fresh loop (``loop``: an ``--event-loop`` value), with an
    overall timeout."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return event_loop.run(bounded(), loop)


@dataclass
class Sleep:
    seconds: float


@dataclass
class Abort:
    details: ErrorDetails


@dataclass
class Hang:
    """Waits forever (until the call is cancelled)."""


Step = worker_pb2.GenerateResponse | Sleep | Abort | Hang


def started(
    n: int = 1, model: str = "SmolLM2-135M-Instruct", prompt_tokens: int = 5
) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(
        started=worker_pb2.Started(model=model, worker_id="worker-a", prompt_tokens=prompt_tokens, n=n)
    )


def content(text: str, index: int = 0, token_ids: tuple[int, ...] = ()) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(
        content=worker_pb2.ContentDelta(choice_index=index, text=text, token_ids=token_ids)
    )


def finished(index: int = 0, reason: int = worker_pb2.STOP, tokens: int = 2) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(
        finished=worker_pb2.Finished(choice_index=index, reason=reason, completion_tokens=tokens)  # type: ignore[arg-type]
    )


def usage(prompt: int = 5, completion: int = 2) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(
        usage=worker_pb2.Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )
    )


@dataclass
class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """A Worker whose Generate plays ``script`` (or ``script_for(request)``) and records what it saw."""

    script: list[Step] = field(default_factory=list)
    script_for: Callable[[worker_pb2.GenerateRequest], list[Step]] | None = None
    worker_id: str = "worker-a"
    models: list[str] = field(default_factory=lambda: ["SmolLM2-135M-Instruct"])
    accepts_images: bool = False  # what its ListModels says of every model
    max_n: int = 0  # the most choices its ListModels says it serves (0: says nothing)
    requests: list[worker_pb2.GenerateRequest] = field(default_factory=list)
    metadata: list[dict[str, str | bytes]] = field(default_factory=list)
    calls_started: int = 0
    calls_cancelled: int = 0
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    async def Generate(  # gRPC method name
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        self.calls_started += 1
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata() or ()))
        script = self.script_for(request) if self.script_for is not None else self.script
        try:
            for step in script:
                if isinstance(step, Sleep):
                    await asyncio.sleep(step.seconds)
                elif isinstance(step, Hang):
                    await asyncio.Event().wait()
                elif isinstance(step, Abort):
                    await context.abort_with_status(build_status(step.details))
                else:
                    yield step
        except (asyncio.CancelledError, GeneratorExit):
            # A cancellation that finds the handler between steps arrives as CancelledError;
            # one that finds it at a ``yield`` (a write in progress) closes the generator.
            self.calls_cancelled += 1
            self.cancelled.set()
            raise

    async def ListModels(  # gRPC method name
        self, request: worker_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ListModelsResponse:
        return worker_pb2.ListModelsResponse(
            models=[
                worker_pb2.ModelInfo(
                    id=m,
                    created=1700000000,
                    owned_by="sluice",
                    accepts_images=self.accepts_images,
                    max_n=self.max_n,
                )
                for m in self.models
            ],
            worker_id=self.worker_id,
        )


@contextlib.asynccontextmanager
async def running_worker(fake: FakeWorker, serving: bool = True) -> AsyncIterator[str]:
    """Serves ``fake`` (plus grpc.health.v1) on 127.0.0.1:<free port>; yields the address."""
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(fake, server)
    health_servicer = health.aio.HealthServicer()
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    await health_servicer.set("", status)
    await health_servicer.set("sluice.v1.Worker", status)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def raw_request(body: dict[str, Any], version: str = "1.1") -> bytes:
    """The bytes of ``POST /v1/chat/completions`` with a JSON ``body``, for tests that talk to the
    edge over a plain socket."""
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/{version}\r\nHost: edge\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


def dead_address() -> str:
    """An address nothing listens on (connection refused)."""
    return f"127.0.0.1:{free_port()}"


# The edge's health-check deadline in these tests (see running_edge).
TEST_HEALTH_TIMEOUT_S = 10.0


@contextlib.asynccontextmanager
async def running_edge(workers: list[str], **overrides: Any) -> AsyncIterator[str]:
    """Serves the edge with hypercorn on a free port; yields its base URL. Its health checks get
    10 s (unless ``overrides`` say otherwise): the fake workers share the test's loop, which a
    loaded machine can hold up past the 2 s default (a CI run saw a fake worker ejected so)."""
    overrides.setdefault("health_timeout_s", TEST_HEALTH_TIMEOUT_S)
    settings = replace(Settings(workers=tuple(workers)), port=free_port(), **overrides)
    stop = asyncio.Event()
    task = asyncio.create_task(serve_edge(settings, stop))
    base = f"http://127.0.0.1:{settings.port}"
    async with httpx.AsyncClient() as client:
        for _ in range(200):
            with contextlib.suppress(httpx.TransportError):
                if (await client.get(f"{base}/health")).status_code == 200:
                    break
            if task.done():
                task.result()
            await asyncio.sleep(0.02)
    try:
        yield base
    finally:
        stop.set()
        await task


async def wait_for(predicate: Callable[[], Awaitable[bool] | bool], within_s: float = 5.0) -> None:
    """Polls ``predicate`` until true or fails the test."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    while True:
        result = predicate()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return
        if loop.time() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


CHAT_BODY: dict[str, Any] = {
    "model": "SmolLM2-135M-Instruct",
    "messages": [{"role": "user", "content": "Hi"}],
}


class ScriptedSource(Generic[T]):
    """An async source of items with scripted pauses (a float is a sleep of that many seconds);
    records how many pauses it entered and how it ended (cancelled, closed)."""

    def __init__(self, script: list[T | float]) -> None:
        self.script = script
        self.cancelled = False
        self.closed = False
        self.reads = 0

    async def items(self) -> AsyncIterator[T]:
        try:
            for step in self.script:
                if isinstance(step, float):
                    self.reads += 1
                    await asyncio.sleep(step)
                else:
                    yield step
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            self.closed = True
