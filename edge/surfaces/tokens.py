"""The worker's Tokenize and Detokenize calls, for the routes that count or convert tokens
(``/tokenize``, ``/detokenize``, ``/v1/messages/count_tokens``): one call on a worker that serves
the request's model (any task: the tokenizer is the model's)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from edge.http import current_pool, current_request_id, current_settings
from sluice.client import Metadata, ReplyT, WorkerClient
from sluice.v1 import worker_pb2


async def tokenize(request: worker_pb2.TokenizeRequest) -> worker_pb2.TokenizeResponse:
    """The worker's ids for ``request``; raises the mapped :class:`~edge.errors.EdgeError`."""
    return await _call(
        request.model,
        lambda client, timeout, metadata: client.tokenize(request, timeout=timeout, metadata=metadata),
    )


async def detokenize(request: worker_pb2.DetokenizeRequest) -> worker_pb2.DetokenizeResponse:
    """The worker's text for ``request``'s ids; raises the mapped :class:`~edge.errors.EdgeError`."""
    return await _call(
        request.model,
        lambda client, timeout, metadata: client.detokenize(request, timeout=timeout, metadata=metadata),
    )


async def _call(model: str, send: Callable[[WorkerClient, float, Metadata], Awaitable[ReplyT]]) -> ReplyT:
    """``send`` on a worker that lists ``model`` (any task), with the request id as metadata."""
    metadata: Metadata = (("x-request-id", current_request_id()),)
    reply, _ = await current_pool().pooled(
        "tokenize",
        model,
        lambda client, timeout: send(client, timeout, metadata),
        current_settings().request_timeout_s,
    )
    return reply
