"""The least a Python relay from gRPC to SSE can do per chunk: the floor under the edge's CPU per chunk.

Run by ``bench/bench_relay_floor.py``, not by hand::

    python bench/relay_floor.py --workers HOST:PORT,HOST:PORT --port PORT

An HTTP/1.1 server on asyncio streams (uvloop, as the edge runs) that answers
every request on a connection, whatever its path and body, with one streamed
``Generate`` call to a worker (the client and channel settings the edge uses,
``sluice.client.WorkerClient``; the same request as the benchmark's direct
path) and, per content event, one chunk of the chunked coding holding one
``data:`` frame shaped like a ``chat.completion.chunk``, then ``data: [DONE]``.
Nothing else: no validation, no routing, no timers, no metrics, no
translation beyond the text, no Quart or hypercorn. What it costs per chunk is
what reading a gRPC message, encoding the text and writing a socket cost in
Python on this machine, which the edge cannot go below.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
from pathlib import Path

import orjson
import uvloop

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_edge_overhead import REQUEST_TIMEOUT_S, direct_request  # noqa: E402

from sluice.client import WorkerCallError, WorkerClient  # noqa: E402

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
PREFIX = (
    b'data: {"id":"chatcmpl-0123456789abcdef0123456789abcdef","object":"chat.completion.chunk",'
    b'"created":1700000000,"model":"SmolLM2-135M-Instruct","system_fingerprint":null,'
    b'"service_tier":null,"choices":[{"index":0,"delta":{"content":'
)
SUFFIX = b'},"logprobs":null,"finish_reason":null}]}\n\n'
END = b"%x\r\ndata: [DONE]\n\n\r\n0\r\n\r\n" % len(b"data: [DONE]\n\n")


class Relay:
    def __init__(self, clients: list[WorkerClient], max_tokens: int) -> None:
        self._clients = clients
        self._max_tokens = max_tokens
        self._requests = itertools.count()

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                await self.respond(writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def respond(self, writer: asyncio.StreamWriter) -> None:
        index = next(self._requests)
        client = self._clients[index % len(self._clients)]
        writer.write(HEAD)
        try:
            request = direct_request(index, self._max_tokens)
            async with client.generate(request, timeout=REQUEST_TIMEOUT_S) as call:
                async for event in call:
                    if event.HasField("content") and event.content.text:
                        frame = PREFIX + orjson.dumps(event.content.text) + SUFFIX
                        writer.write(b"%x\r\n%b\r\n" % (len(frame), frame))
                        await writer.drain()
        except WorkerCallError:
            pass
        writer.write(END)
        await writer.drain()


async def serve(workers: list[str], port: int, max_tokens: int) -> None:
    clients = [WorkerClient(address) for address in workers]
    relay = Relay(clients, max_tokens)
    server = await asyncio.start_server(relay.connection, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", required=True, help="comma-separated worker addresses")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(args.workers.split(","), args.port, args.max_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
