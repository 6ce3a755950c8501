"""Named-event framing (Responses, Anthropic, native) and how the stream metrics read it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from edge_fakes import run

from edge import sse
from edge.metrics import EdgeMetrics

FRAMING = sse.Framing("anthropic", named=True, done=None, output_events=frozenset({"content_block_delta"}))


def test_named_frame_takes_its_name_from_the_payload_type() -> None:
    frame = sse.named_frame({"type": "message_start", "text": "a\nb"})
    assert frame == b'event: message_start\ndata: {"type":"message_start","text":"a\\nb"}\n\n'
    assert FRAMING.frame({"type": "ping"}) == b'event: ping\ndata: {"type":"ping"}\n\n'
    assert FRAMING.event_name(frame) == "message_start"
    assert FRAMING.event_name(sse.HEARTBEAT_FRAME) is None
    assert sse.OPENAI_FRAMING.frame({"a": 1}) == b'data: {"a":1}\n\n'


def test_heartbeats_use_the_framings_frame() -> None:
    async def slow() -> AsyncIterator[bytes]:
        await asyncio.sleep(0.2)
        yield b"x"

    async def body() -> list[bytes]:
        return [f async for f in sse.with_heartbeats(slow(), 0.05, sse.ANTHROPIC_PING_FRAME)]

    frames = run(body())
    assert frames[-1] == b"x" and sse.ANTHROPIC_PING_FRAME in frames
    assert sse.HEARTBEAT_FRAME not in frames


def test_metrics_count_named_output_and_error_events_by_surface() -> None:
    metrics = EdgeMetrics()
    frames = [
        FRAMING.frame({"type": "message_start"}),
        FRAMING.frame({"type": "content_block_delta", "delta": {"text": "a"}}),
        sse.ANTHROPIC_PING_FRAME,
        FRAMING.frame({"type": "content_block_delta", "delta": {"text": "b"}}),
        FRAMING.frame({"type": "error", "error": {"type": "timeout_error", "message": "m"}}),
    ]

    async def source() -> AsyncIterator[bytes]:
        for frame in frames:
            yield frame

    async def body() -> list[bytes]:
        return [f async for f in metrics.watch(source(), 0.0, "r1", FRAMING)]

    assert run(body()) == frames
    assert (metrics.time_to_first_token.count, metrics.chunk_gap.count) == (1, 1)
    assert metrics.stream_errors == {("timeout_error", "unknown"): 1}
    assert metrics.surface_streams == {("anthropic", "error"): 1}
