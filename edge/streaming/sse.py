"""Server-Sent Events framing (the heartbeats' timer is the stream pump's, :mod:`edge.streaming.pump`).

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

from typing import Any

import orjson

DONE_FRAME = b"data: [DONE]\n\n"
HEARTBEAT_FRAME = b": heartbeat\n\n"


# Keys that are not strings (an int key of a dict, as the standard encoder allowed) are written
# as strings instead of raising.
_OPTIONS = orjson.OPT_NON_STR_KEYS


def dumps(obj: Any) -> str:
    """Compact JSON (no spaces, non-ASCII as it is). JSON escapes newlines, so a payload is one
    SSE line. orjson, not the standard library: this runs once per streamed chunk, and the
    standard encoder took about a tenth of the edge's CPU per chunk at full speed
    (docs/benchmarks.md). Floats are written in their shortest form (``1e-5``, not ``1e-05``),
    which every JSON parser reads as the same number."""
    return orjson.dumps(obj, option=_OPTIONS).decode("utf-8")


def data_frame(obj: Any) -> bytes:
    """One normal event: ``data: <json>`` and a blank line."""
    return b"data: " + orjson.dumps(obj, option=_OPTIONS) + b"\n\n"


def error_frame(payload: Any) -> bytes:
    """A mid-stream error event; the caller sends :data:`DONE_FRAME` after it."""
    return b"event: error\ndata: " + orjson.dumps(payload, option=_OPTIONS) + b"\n\n"


def named_frame(obj: dict[str, Any]) -> bytes:
    """One named event (the Responses, Anthropic and native surfaces): ``event: <obj["type"]>``,
    then ``data: <json>`` and a blank line. All three put the event's name in its payload's
    ``type`` (``response.created``, ``message_start``, ``chat.start``), so it is read from there."""
    name = str(obj["type"]).encode("utf-8")
    return b"event: " + name + b"\ndata: " + orjson.dumps(obj, option=_OPTIONS) + b"\n\n"


# Anthropic's SSE clients skip a `ping` event; its API sends one to keep an idle stream open.
ANTHROPIC_PING_FRAME = b'event: ping\ndata: {"type":"ping"}\n\n'
