"""Reading a worker's ``Generate`` answer over gRPC in integration tests."""

from __future__ import annotations

import grpc

from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc


def ids_and_prompt_logprobs(address: str, request: pb.GenerateRequest) -> tuple[list[int], list[float]]:
    """The generated token ids and the prompt's logprobs of ``request`` (which asks for both)."""
    ids: list[int] = []
    scored: list[float] = []
    with grpc.insecure_channel(address) as channel:
        for event in pb_grpc.WorkerStub(channel).Generate(request, timeout=60):
            kind = event.WhichOneof("event")
            if kind == "content":
                ids += list(event.content.token_ids)
            elif kind == "prompt_logprobs":
                scored = [entry.logprob for entry in event.prompt_logprobs.logprobs]
    return ids, scored
