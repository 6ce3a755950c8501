"""Server-Sent Events framing (the heartbeats' timer is the stream pump's, :mod:`edge.stream_pump`).

Wire rules (DESIGN.md section 3): a normal chunk is exactly ``data: <json>\\n\\n``
with compact JSON and no ``event:`` or ``id:`` line (openai-python breaks on
both); the stream ends with ``data: [DONE]\\n\\n``; a mid-stream failure is
``event: error\\ndata: <json>\\n\\n`` followed by ``[DONE]``; a heartbeat is the
comment ``: heartbeat\\n\\n``, which every SSE client ignores.
"""

from __future__ import annotations

import json
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


def named_frame(obj: dict[str, Any]) -> bytes:
    """One named event (the Responses, Anthropic and native surfaces): ``event: <obj["type"]>``,
    then ``data: <json>`` and a blank line. All three put the event's name in its payload's
    ``type`` (``response.created``, ``message_start``, ``chat.start``), so it is read from there."""
    return b"event: " + str(obj["type"]).encode("utf-8") + b"\ndata: " + dumps(obj).encode("utf-8") + b"\n\n"


# Anthropic's SSE clients skip a `ping` event; its API sends one to keep an idle stream open.
ANTHROPIC_PING_FRAME = b'event: ping\ndata: {"type":"ping"}\n\n'
