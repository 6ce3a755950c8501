"""An edge with ``--multiplexed-streams`` in front of fake workers without ``GenerateStreams``
(the generated base class's): every request is answered by ``Generate``, never a 500, whether
the worker's ListModels leaves ``generate_streams`` unset or claims it and the call then fails."""

from __future__ import annotations

from typing import Any

import grpc
import httpx
import pytest
from edge_fakes import (
    CHAT_BODY,
    FakeWorker,
    content,
    finished,
    run,
    running_edge,
    running_worker,
    started,
    usage,
)

from sluice.v1 import worker_pb2

STREAM_BODY = {**CHAT_BODY, "stream": True}


class Claims(FakeWorker):
    """Says it serves GenerateStreams; the call then fails as ``failure`` says."""

    failure = "base"

    async def ListModels(  # gRPC method name
        self, request: worker_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ListModelsResponse:
        listing = await super().ListModels(request, context)
        listing.generate_streams = True
        return listing

    async def GenerateStreams(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> Any:  # gRPC name
        if self.failure == "internal":
            await context.abort(grpc.StatusCode.INTERNAL, "not here")
        if self.failure == "raise":
            raise RuntimeError("a bug")  # UNKNOWN
        return await super().GenerateStreams(request_iterator, context)  # the base class's refusal


def fake(kind: str) -> FakeWorker:
    script = [started(), content("Hel"), content("lo"), finished(), usage()]
    if kind == "plain":
        return FakeWorker(script=script)
    claims = Claims(script=script)
    claims.failure = kind
    return claims


@pytest.mark.parametrize("kind", ["plain", "base", "internal", "raise"])
def test_an_edge_with_multiplexed_streams_answers_by_generate_a_worker_without_them(kind: str) -> None:
    worker = fake(kind)

    async def body() -> None:
        async with (
            running_worker(worker) as address,
            running_edge([address], multiplexed_streams=True) as base,
            httpx.AsyncClient(timeout=10) as client,
        ):
            for _ in range(2):
                reply = await client.post(f"{base}/v1/chat/completions", json=STREAM_BODY)
                assert reply.status_code == 200 and reply.text.endswith("data: [DONE]\n\n")
                assert '"Hel"' in reply.text and '"lo"' in reply.text

    run(body())
    assert worker.calls_started == 2  # each request once, by Generate
