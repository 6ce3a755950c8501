"""What the named-event surfaces' routes (Responses, Anthropic Messages, native) share.

Each of them has one translator per response (:class:`SurfaceTranslator`) and
answers either one JSON body (:func:`answer_json`) or a stream of named events
(:func:`answer_stream`); both sit on :mod:`edge.routes.generation`, whose call
order, time limits and cancellation rules apply unchanged. This is the one
place where a surface's translator meets the stream machinery.
"""

from __future__ import annotations

from typing import Any, Protocol

from quart.wrappers import Response

from edge import sse
from edge.call_group import CallGroup
from edge.errors import EdgeError
from edge.routes.common import json_response
from edge.routes.generation import StreamFraming, collect, sse_response
from sluice.v1 import worker_pb2


class SurfaceTranslator(Protocol):
    """A pure events → surface translator (:mod:`edge.translate_responses` and friends)."""

    def on_event(self, event: worker_pb2.GenerateResponse) -> list[dict[str, Any]]: ...

    def add(self, event: worker_pb2.GenerateResponse) -> None: ...

    def finish(self) -> list[dict[str, Any]]: ...

    def on_error(self, error: EdgeError) -> list[dict[str, Any]]: ...

    def result(self) -> dict[str, Any]: ...


async def answer_json(group: CallGroup, translator: SurfaceTranslator, headers: dict[str, str]) -> Response:
    """Feeds every event to ``translator`` and answers its result (``stream: false``)."""
    await collect(group, lambda _call, event: translator.add(event))
    return json_response(translator.result(), headers=headers)


def answer_stream(
    group: CallGroup,
    translator: SurfaceTranslator,
    headers: dict[str, str],
    surface: str,
    heartbeat: bytes = sse.HEARTBEAT_FRAME,
) -> Response:
    """The stream of ``translator``'s named events (:func:`edge.sse.named_frame`), with no
    ``[DONE]``; a failure is the translator's own error events; ``heartbeat`` is sent after
    each silence (a comment line, or Anthropic's ``ping`` event); ``surface`` labels the
    stream's metrics."""

    def error_frames(error: EdgeError) -> bytes:
        return b"".join(sse.named_frame(event) for event in translator.on_error(error))

    framing = StreamFraming(
        encode=sse.named_frame, heartbeat=heartbeat, end=b"", error=error_frames, surface=surface
    )
    return sse_response(
        group, lambda _call, event: translator.on_event(event), translator.finish, headers, framing=framing
    )
