"""Registers the ``sluice.v1.Worker`` service so that undecodable request bytes are the caller's error.

Design notes: docs/worker.md.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from worker.errors import InvalidRequest

SERVICE = "sluice.v1.Worker"


@dataclass(frozen=True)
class UndecodableRequest:
    """What the decoder hands on for bytes that are not a valid request of ``message_name``."""

    message_name: str
    reason: str

    def error(self) -> InvalidRequest:
        return InvalidRequest(
            f"the request is not a valid {self.message_name}: {self.reason}", param="request"
        )


def lenient_decoder(message: type[Message]) -> Callable[[bytes], Any]:
    """A request deserializer that never raises: a message, or an :class:`UndecodableRequest`."""
    name = message.DESCRIPTOR.full_name

    def decode(data: bytes) -> Message | UndecodableRequest:
        try:
            return message.FromString(data)
        except DecodeError as error:
            return UndecodableRequest(name, str(error) or "malformed protobuf")

    return decode


def add_worker_service(servicer: pb_grpc.WorkerServicer, server: grpc.aio.Server) -> None:
    """Registers ``servicer`` (Generate, GenerateStreams, ListModels, Embed, Score, Tokenize,
    Detokenize, the LoRA loads) on ``server``, in place of the generated ``add_WorkerServicer_to_server``."""

    async def generate(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        if isinstance(request, UndecodableRequest):
            await context.abort_with_status(request.error().to_status())
            return
        responses = servicer.Generate(request, context)
        try:
            async for response in responses:
                yield response
        finally:
            await responses.aclose()  # at once, whether the call ended, failed or was cancelled

    def unary(method: Callable[[Any, grpc.aio.ServicerContext], Any], request_type: type[Message]) -> Any:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, UndecodableRequest):
                await context.abort_with_status(request.error().to_status())
            return await method(request, context)

        return grpc.unary_unary_rpc_method_handler(
            handle,
            request_deserializer=lenient_decoder(request_type),
            response_serializer=lambda reply: reply.SerializeToString(),
        )

    async def generate_streams(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
        # Undecodable messages reach the service, which ends the call with INVALID_ARGUMENT.
        await servicer.GenerateStreams(requests, context)

    handlers = {
        "GenerateStreams": grpc.stream_stream_rpc_method_handler(
            generate_streams,
            request_deserializer=lenient_decoder(pb.StreamsRequest),
            response_serializer=pb.StreamsResponse.SerializeToString,
        ),
        "Generate": grpc.unary_stream_rpc_method_handler(
            generate,
            request_deserializer=lenient_decoder(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "ListModels": unary(servicer.ListModels, pb.ListModelsRequest),
        "Embed": unary(servicer.Embed, pb.EmbedRequest),
        "Score": unary(servicer.Score, pb.ScoreRequest),
        "Tokenize": unary(servicer.Tokenize, pb.TokenizeRequest),
        "Detokenize": unary(servicer.Detokenize, pb.DetokenizeRequest),
        "LoadLoraAdapter": unary(servicer.LoadLoraAdapter, pb.LoadLoraAdapterRequest),
        "UnloadLoraAdapter": unary(servicer.UnloadLoraAdapter, pb.UnloadLoraAdapterRequest),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
