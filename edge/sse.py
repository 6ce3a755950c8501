"""Server-Sent Events framing and timer-driven heartbeats.

Wire rules (DESIGN.md section 3): a normal chunk is exactly ``data: <json>\\n\\n``
with compact JSON and no ``event:`` or ``id:`` line (openai-python breaks on
both); the stream ends with ``data: [DONE]\\n\\n``; a mid-stream failure is
``event: error\\ndata: <json>\\n\\n`` followed by ``[DONE]``; a heartbeat is the
comment ``: heartbeat\\n\\n``, which every SSE client ignores.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterable
from typing import Any

DONE_FRAME = b"data: [DONE]\n\n"
HEARTBEAT_FRAME = b": heartbeat\n\n"


# Built once: json.dumps with options builds a new encoder on every call (once per chunk here).
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def dumps(obj: Any) -> str:
    """Compact JSON (no spaces). JSON escapes newlines, so a payload is one SSE line."""
    return _ENCODER.encode(obj)


def data_frame(obj: Any) -> bytes:
    """One normal event: ``data: <json>`` and a blank line."""
    return b"data: " + dumps(obj).encode("utf-8") + b"\n\n"


def error_frame(payload: Any) -> bytes:
    """A mid-stream error event; the caller sends :data:`DONE_FRAME` after it."""
    return b"event: error\ndata: " + dumps(payload).encode("utf-8") + b"\n\n"


async def with_heartbeats(frames: AsyncIterable[bytes], interval_s: float) -> AsyncGenerator[bytes, None]:
    """Yields ``frames``, plus :data:`HEARTBEAT_FRAME` after each ``interval_s`` of silence.

    Timer-driven: one ``anext()`` task on the source stays pending across
    heartbeats (cancelling it would cancel the source, i.e. the gRPC call), and
    ``asyncio.wait`` with a timeout decides when to beat. The timer restarts
    after every frame handed out.

    When this generator is cancelled (client disconnect) or closed early, the
    pending read is cancelled and awaited, then the source is closed, so the
    source's own cleanup (cancelling its call) has run before this returns;
    the cancellation is re-raised.
    """
    source = aiter(frames)
    pending: asyncio.Future[bytes] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield HEARTBEAT_FRAME
                continue
            finished, pending = pending, None
            try:
                frame = finished.result()
            except StopAsyncIteration:
                return
            yield frame
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            # Let the source observe its cancellation before we go; wait() never raises the
            # task's own CancelledError, only ours if we are cancelled again meanwhile.
            await asyncio.wait({pending})
        if pending is not None and pending.done() and not pending.cancelled():
            pending.exception()  # retrieved, so asyncio does not log "never retrieved"
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(RuntimeError):  # "already running": its task was just cancelled
                await aclose()
