"""A streamed body written straight to its HTTP/1.1 connection (edge.streaming.connections.ChunkedBody),
with the edge served by hypercorn in-process against a fake worker; the bytes are read off a raw
socket, so the chunked coding itself is checked, not a client's view of it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest
from edge_fakes import (
    CHAT_BODY,
    FakeWorker,
    Step,
    content,
    finished,
    raw_request,
    run,
    running_edge,
    running_worker,
    started,
    usage,
)

from edge.streaming.connections import ChunkedBody

STREAM_BODY = {**CHAT_BODY, "stream": True}
HAPPY: list[Step] = [started(), content("Hel"), content("lo"), finished(), usage()]
BOTH_LOOPS = pytest.mark.parametrize("loop", ["asyncio", "uvloop"])


@contextlib.asynccontextmanager
async def edge_connection() -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A plain socket connection to an edge in front of a worker that streams "Hello"."""
    async with running_worker(FakeWorker(script=HAPPY)) as address, running_edge([address]) as base:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(base.rsplit(":", 1)[1]))
        try:
            yield reader, writer
        finally:
            writer.close()


async def read_head(reader: asyncio.StreamReader) -> dict[str, str]:
    status = await reader.readline()
    assert status.split()[1] == b"200", status
    headers: dict[str, str] = {}
    while (line := await reader.readline()) != b"\r\n":
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return headers


async def read_chunked(reader: asyncio.StreamReader) -> list[bytes]:
    """The chunks of one chunked body, up to and including its empty last chunk (then nothing)."""
    chunks: list[bytes] = []
    while True:
        size = int((await reader.readline()).strip(), 16)
        data = await reader.readexactly(size)
        assert await reader.readexactly(2) == b"\r\n"
        if size == 0:
            return chunks
        chunks.append(data)


def frames_of(body: bytes) -> list[str]:
    return [frame for frame in body.decode().split("\n\n") if frame]


def content_of(frames: list[str]) -> str:
    text = ""
    for frame in frames:
        if frame.startswith("data: {"):
            for choice in json.loads(frame[6:])["choices"]:
                text += choice["delta"].get("content") or ""
    return text


@pytest.fixture
def direct_writes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every body write that went straight to a connection."""
    written: list[bytes] = []
    original = ChunkedBody.write

    def counting(self: ChunkedBody, data: bytes) -> None:
        written.append(data)
        original(self, data)

    monkeypatch.setattr(ChunkedBody, "write", counting)
    return written


@BOTH_LOOPS
def test_a_stream_over_http11_goes_straight_to_the_connection_and_the_connection_stays_usable(
    direct_writes: list[bytes], loop: str
) -> None:
    async def body() -> None:
        async with edge_connection() as (reader, writer):
            for _ in range(2):  # the same keep-alive connection twice: h11's state stayed right
                writer.write(raw_request(STREAM_BODY))
                headers = await asyncio.wait_for(read_head(reader), 10)
                assert headers["transfer-encoding"] == "chunked"
                assert headers["content-type"].startswith("text/event-stream")
                frames = frames_of(b"".join(await asyncio.wait_for(read_chunked(reader), 10)))
                assert content_of(frames) == "Hello"
                assert json.loads(frames[0][6:])["choices"][0]["delta"]["role"] == "assistant"
                assert frames[-1] == "data: [DONE]"

    run(body(), loop=loop)
    # Every frame of both responses went out as direct chunks; Quart and hypercorn sent only the
    # heads and the empty last chunks.
    assert direct_writes
    assert frames_of(b"".join(direct_writes))[-1] == "data: [DONE]"
    assert content_of(frames_of(b"".join(direct_writes))) == "HelloHello"


def test_an_http10_client_gets_the_stream_through_hypercorn_without_the_chunked_coding(
    direct_writes: list[bytes],
) -> None:
    async def body() -> None:
        async with edge_connection() as (reader, writer):
            writer.write(raw_request(STREAM_BODY, version="1.0"))
            headers = await asyncio.wait_for(read_head(reader), 10)
            assert "transfer-encoding" not in headers
            rest = await asyncio.wait_for(reader.read(), 10)  # the body ends with the connection
            frames = frames_of(rest)
            assert content_of(frames) == "Hello" and frames[-1] == "data: [DONE]"

    run(body(), loop="asyncio")
    assert direct_writes == []
