"""Sending a pooled call (``Embed`` or ``Score``) for a surface: the drain check, the request's
deadline, the worker that serves the model for that task (:meth:`WorkerPool.pooled`)."""

from __future__ import annotations

from typing import Any

from quart import request
from quart.wrappers import Response

from edge.deadlines import IDLE_TIMEOUT_HEADER, TIMEOUT_HEADER, request_limits
from edge.drain import shutting_down_error
from edge.http import current_request_id, json_response, worker_header
from edge.rate_limits import request_meter
from edge.state import current_state
from sluice.client import WorkerClient
from sluice.v1 import worker_pb2

# The gRPC deadline falls this much after the request's own, as for generations.
_DEADLINE_MARGIN_S = 1.0


async def embed(worker_request: worker_pb2.EmbedRequest) -> tuple[worker_pb2.EmbedResponse, str]:
    """The worker's answer and its id; raises :class:`~edge.errors.EdgeError`."""

    async def send(client: WorkerClient, remaining: float) -> worker_pb2.EmbedResponse:
        return await client.embed(worker_request, timeout=remaining)

    return await _call("embed", worker_request.model, send)


async def score(worker_request: worker_pb2.ScoreRequest) -> tuple[worker_pb2.ScoreResponse, str]:
    """The worker's answer and its id; raises :class:`~edge.errors.EdgeError`."""

    async def send(client: WorkerClient, remaining: float) -> worker_pb2.ScoreResponse:
        return await client.score(worker_request, timeout=remaining)

    return await _call("score", worker_request.model, send)


async def _call(kind: str, model: str, send: Any) -> Any:
    state = current_state()
    if state.drain.draining:
        raise shutting_down_error()
    limits = request_limits(
        request.headers.get(TIMEOUT_HEADER), request.headers.get(IDLE_TIMEOUT_HEADER), state.settings
    )
    reply, worker = await state.pool.pooled(kind, model, send, limits.total_s + _DEADLINE_MARGIN_S)
    if (meter := request_meter()) is not None:  # a key's tokens per minute count pooled inputs too
        meter.charge(reply.prompt_tokens)
    return reply, reply.worker_id or worker.worker_id or ""


def answer(body: Any, worker_id: str) -> Response:
    """The 200 JSON answer with ``X-Sluice-Worker-ID``."""
    headers = {"X-Request-ID": current_request_id(), **worker_header([worker_id] if worker_id else [])}
    return json_response(body, headers=headers)
