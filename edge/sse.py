"""Server-Sent Events framing and timer-driven heartbeats.

Wire rules (DESIGN.md section 3): a normal chunk is exactly ``data: <json>\\n\\n``
with compact JSON and no ``event:`` or ``id:`` line (openai-python breaks on
both); the stream ends with ``data: [DONE]\\n\\n``; a mid-stream failure is
``event: error\\ndata: <json>\\n\\n`` followed by ``[DONE]``; a heartbeat is the
comment ``: heartbeat\\n\\n``, which every SSE client ignores.

The other HTTP surfaces name every event instead (:class:`Framing`:
``event: <type>`` then ``data: <json>``, no ``[DONE]``; Anthropic's heartbeat
is its ``ping`` event).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterable
from dataclasses import dataclass
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


async def with_heartbeats(
    frames: AsyncIterable[bytes], interval_s: float, heartbeat: bytes = HEARTBEAT_FRAME
) -> AsyncGenerator[bytes, None]:
    """Yields ``frames``, plus ``heartbeat`` (default :data:`HEARTBEAT_FRAME`) after each
    ``interval_s`` of silence.

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
                yield heartbeat
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


# ------------------------------------------------------------------ framings
# The OpenAI chat and completions streams above are one framing; the other HTTP surfaces
# (Responses, Anthropic Messages, the native /api/v1/chat stream) name every event instead.


def named_frame(obj: dict[str, Any]) -> bytes:
    """One named event: ``event: <obj["type"]>``, then ``data: <json>`` and a blank line.

    All three named-event surfaces put the event's name in its payload's ``type``
    (``response.created``, ``message_start``, ``chat.start``), so the name is read from there.
    """
    return b"event: " + str(obj["type"]).encode("utf-8") + b"\ndata: " + dumps(obj).encode("utf-8") + b"\n\n"


@dataclass(frozen=True)
class Framing:
    """How one HTTP surface writes its stream: the event frame, the heartbeat, the last frame.

    ``surface`` labels the surface's metrics. ``output_events`` are the event names
    that carry generated output (the metrics' time to first token and chunk gaps);
    with unnamed events every ``data:`` frame but ``[DONE]`` and role chunks is output.
    """

    surface: str
    named: bool = False
    heartbeat: bytes = HEARTBEAT_FRAME
    done: bytes | None = DONE_FRAME
    output_events: frozenset[str] = frozenset()

    def frame(self, obj: dict[str, Any]) -> bytes:
        return named_frame(obj) if self.named else data_frame(obj)

    def event_name(self, frame: bytes) -> str | None:
        """The ``event:`` name of a frame this framing wrote (None for an unnamed frame)."""
        if not frame.startswith(b"event: "):
            return None
        return frame[7 : frame.find(b"\n")].decode("utf-8", "replace")


OPENAI_FRAMING = Framing("openai")
# Anthropic's SSE clients skip a `ping` event; its docs send one to keep idle streams open.
ANTHROPIC_PING_FRAME = b'event: ping\ndata: {"type":"ping"}\n\n'
