"""SSE framing and the timer-driven heartbeat wrapper."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from edge_fakes import ScriptedSource, run

from edge.sse import DONE_FRAME, HEARTBEAT_FRAME, data_frame, dumps, error_frame, with_heartbeats


def test_frames_are_exact() -> None:
    assert data_frame({"a": 1, "b": [1, 2]}) == b'data: {"a":1,"b":[1,2]}\n\n'
    assert data_frame({"t": "line1\nline2 é"}) == 'data: {"t":"line1\\nline2 é"}\n\n'.encode()
    assert DONE_FRAME == b"data: [DONE]\n\n"
    assert HEARTBEAT_FRAME == b": heartbeat\n\n"
    assert error_frame({"error": {"message": "x"}}) == b'event: error\ndata: {"error":{"message":"x"}}\n\n'
    assert dumps({"a": None}) == '{"a":null}'


async def collect(it: AsyncIterator[bytes]) -> list[bytes]:
    return [frame async for frame in it]


def test_no_heartbeat_when_frames_keep_coming() -> None:
    source = ScriptedSource([b"a", b"b"])
    assert run(collect(with_heartbeats(source.items(), 0.05))) == [b"a", b"b"]
    assert source.closed and not source.cancelled


def test_heartbeats_during_silence_without_cancelling_the_pending_read() -> None:
    source = ScriptedSource([b"a", 0.28, b"b"])
    frames = run(collect(with_heartbeats(source.items(), 0.05)))
    assert frames[0] == b"a" and frames[-1] == b"b"
    beats = frames[1:-1]
    assert 3 <= len(beats) <= 6 and set(beats) == {HEARTBEAT_FRAME}
    # The one sleep ran to completion: heartbeats never cancelled or restarted the read.
    assert source.reads == 1 and not source.cancelled


def test_heartbeat_before_the_first_frame() -> None:
    source = ScriptedSource([0.12, b"a"])
    frames = run(collect(with_heartbeats(source.items(), 0.05)))
    assert frames[0] == HEARTBEAT_FRAME and frames[-1] == b"a"


def test_source_errors_propagate() -> None:
    async def failing() -> AsyncIterator[bytes]:
        yield b"a"
        raise ValueError("boom")

    async def body() -> list[bytes]:
        got: list[bytes] = []
        with pytest.raises(ValueError, match="boom"):
            async for frame in with_heartbeats(failing(), 0.05):
                got.append(frame)
        return got

    assert run(body()) == [b"a"]


def test_cancellation_cancels_the_pending_read_and_propagates() -> None:
    source = ScriptedSource([b"a", 10.0, b"never"])

    async def body() -> None:
        got: list[bytes] = []

        async def consume() -> None:
            async for frame in with_heartbeats(source.items(), 0.05):
                got.append(frame)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.17)  # "a" plus a few heartbeats, read still pending
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert got[0] == b"a" and HEARTBEAT_FRAME in got

    run(body())
    assert source.cancelled and source.closed


def test_aclose_at_a_yield_closes_the_source() -> None:
    source = ScriptedSource([b"a", b"b", b"c"])

    async def body() -> None:
        wrapped = with_heartbeats(source.items(), 0.05)
        assert await anext(wrapped) == b"a"
        await wrapped.aclose()

    run(body())
    assert source.closed
