"""``WorkerClient.open_stream`` against in-process gRPC servers whose servicer comes from the
generated base class without ``GenerateStreams`` (an older worker, a test's fake): whatever its
ListModels says and however the call fails, every request is answered by ``Generate``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from sluice.client import WorkerClient
from sluice.streams import StreamCall
from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc


class OldWorker(worker_pb2_grpc.WorkerServicer):
    """Serves ``Generate`` (one content event) and nothing of ``GenerateStreams``."""

    def __init__(self) -> None:
        self.generated = 0

    async def Generate(  # gRPC method name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.generated += 1
        yield pb.GenerateResponse(started=pb.Started(request_id=request.request_id))
        yield pb.GenerateResponse(content=pb.ContentDelta(text=request.request_id))


class SaysNo(OldWorker):
    async def ListModels(  # gRPC method name
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.ModelInfo(id="m")], worker_id="old")


class SaysYes(OldWorker):
    """Claims ``GenerateStreams`` but leaves it to the base class (which fails the call)."""

    async def ListModels(  # gRPC method name
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(worker_id="liar", generate_streams=True)


class Raises(SaysYes):
    async def GenerateStreams(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> Any:  # gRPC name
        raise RuntimeError("a bug")  # UNKNOWN


class AbortsInternal(SaysYes):
    async def GenerateStreams(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> Any:  # gRPC name
        await context.abort(grpc.StatusCode.INTERNAL, "not here")


async def answers(servicer: OldWorker, requests: int) -> list[tuple[str, bool]]:
    """Serves ``servicer``; opens ``requests`` streams at once; each one's text and whether it
    stayed multiplexed."""
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with WorkerClient(f"127.0.0.1:{port}") as client:
            calls = [
                client.open_stream(pb.GenerateRequest(request_id=f"r{i}"), timeout=30)
                for i in range(requests)
            ]

            async def text(call: Any) -> tuple[str, bool]:
                events = []
                while (event := await call.read()) is not None:
                    events.append(event)
                return "".join(e.content.text for e in events), isinstance(
                    call, StreamCall
                ) and call.multiplexed

            return list(await asyncio.gather(*(text(call) for call in calls)))
    finally:
        await server.stop(None)


@pytest.mark.parametrize("servicer", [OldWorker, SaysNo, SaysYes, Raises, AbortsInternal])
def test_a_worker_without_generate_streams_answers_every_request_by_generate(
    servicer: type[OldWorker],
) -> None:
    fake = servicer()
    result = asyncio.run(answers(fake, 3))
    assert result == [(f"r{i}", False) for i in range(3)]
    assert fake.generated == 3
