"""CPU per token of the edge's stream plumbing alone: fake worker calls in, SSE body bytes out.

Usage::

    python bench/bench_stream_plumbing.py                  # 64 streams of 256 tokens
    PYTHONPATH=/path/to/older/checkout python bench/bench_stream_plumbing.py   # the same, older edge
    python bench/bench_stream_plumbing.py --event-loop asyncio   # on asyncio's loop (default: uvloop)

No gRPC and no HTTP: each stream is a fake call that yields a ``started``
event, ``--tokens`` content events (one per event-loop iteration, as gRPC
reads deliver them), a ``finished`` and a ``usage`` event; the body is
consumed as Quart would (iterated, then closed) without sending anything.
It prints the process CPU time per token for the edge's streaming body and,
for reference, for the floor: the same fake calls, translation and framing
with no plumbing at all. On a checkout from before the stream pump (no
``edge/streaming/pump.py``) it measures the older body (deadline guard,
heartbeat wrapper, metrics wrapper) instead.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edge.deadlines import EventGuard, TimeLimits
from edge.drain import Drain
from edge.metrics import EdgeMetrics
from edge.streaming import sse
from edge.surfaces.chat.translate import ChatTranslator
from edge.workers.call_group import CallGroup
from sluice.v1 import worker_pb2 as pb

LIMITS = TimeLimits(total_s=600.0, idle_s=120.0)


class FakeCall:
    """A started call that streams ``tokens`` content events, one per loop iteration."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.first = pb.GenerateResponse(started=pb.Started(model="m", worker_id="w", n=1))

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        return self._events()

    async def _events(self) -> AsyncIterator[pb.GenerateResponse]:
        yield self.first
        for i in range(self.tokens):
            await asyncio.sleep(0)
            yield pb.GenerateResponse(content=pb.ContentDelta(text=" word", token_ids=[i]))
        yield pb.GenerateResponse(finished=pb.Finished(reason=pb.LENGTH))
        yield pb.GenerateResponse(usage=pb.Usage(completion_tokens=self.tokens))

    def cancel(self) -> None:
        pass


def streaming_body(tokens: int, metrics: EdgeMetrics, drain: Drain) -> AsyncIterable[bytes]:
    builder = ChatTranslator("chatcmpl-1", 1, "m", include_usage=True)
    group = CallGroup([FakeCall(tokens)])  # type: ignore[list-item]
    try:
        from edge.streaming.pump import OPENAI_FRAMING, PumpClock, StreamPump
    except ImportError:  # a checkout from before the pump
        from edge.surfaces.generation import _frames  # type: ignore[attr-defined]

        frames = _frames(
            group, EventGuard(LIMITS), drain, lambda _c, e: builder.on_event(0, e), builder.finish, "r"
        )
        return metrics.watch(sse.with_heartbeats(frames, 15.0), time.monotonic(), "r")  # type: ignore[attr-defined]
    loop = asyncio.get_running_loop()
    clock = PumpClock(LIMITS, loop.time() + LIMITS.total_s, heartbeat_s=15.0, write_timeout_s=30.0)
    return StreamPump(
        group,
        lambda _call, event: builder.on_event(0, event),
        builder.finish,
        OPENAI_FRAMING,
        clock,
        metrics=metrics,
        drain=drain,
        request_id="r",
        started_at=time.monotonic(),
    )


async def consume(body: AsyncIterable[bytes]) -> int:
    writes = 0
    async for _ in body:
        writes += 1
    aclose: Any = getattr(body, "aclose", None)
    if aclose is not None:
        await aclose()
    return writes


async def floor(tokens: int) -> None:
    builder = ChatTranslator("chatcmpl-1", 1, "m", include_usage=True)
    async for event in FakeCall(tokens):
        for chunk in builder.on_event(0, event):
            sse.data_frame(chunk)


async def main(streams: int, tokens: int) -> None:
    metrics, drain = EdgeMetrics(), Drain()
    cpu = time.process_time()
    writes = await asyncio.gather(*(consume(streaming_body(tokens, metrics, drain)) for _ in range(streams)))
    body_us = 1e6 * (time.process_time() - cpu) / (streams * tokens)
    cpu = time.process_time()
    await asyncio.gather(*(floor(tokens) for _ in range(streams)))
    floor_us = 1e6 * (time.process_time() - cpu) / (streams * tokens)
    print(
        f"{streams} streams x {tokens} tokens: streaming body {body_us:.1f} us CPU per token "
        f"({sum(writes) / streams:.0f} writes per stream); floor (fake calls, translation, framing) "
        f"{floor_us:.1f} us"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument(
        "--event-loop", default="auto", help="auto (uvloop where installed), uvloop or asyncio, as the edge's"
    )
    args = parser.parse_args()
    try:
        from edge import event_loop
    except ImportError:  # an older checkout: asyncio's loop only
        asyncio.run(main(args.streams, args.tokens))
    else:
        event_loop.run(main(args.streams, args.tokens), args.event_loop)
