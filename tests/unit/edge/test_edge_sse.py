"""SSE framing (the heartbeats are the stream pump's: test_edge_stream_pump.py)."""

from __future__ import annotations

from edge.streaming.sse import DONE_FRAME, HEARTBEAT_FRAME, data_frame, dumps, error_frame


def test_frames_are_exact() -> None:
    assert data_frame({"a": 1, "b": [1, 2]}) == b'data: {"a":1,"b":[1,2]}\n\n'
    assert data_frame({"t": "line1\nline2 é"}) == 'data: {"t":"line1\\nline2 é"}\n\n'.encode()
    assert DONE_FRAME == b"data: [DONE]\n\n"
    assert HEARTBEAT_FRAME == b": heartbeat\n\n"
    assert error_frame({"error": {"message": "x"}}) == b'event: error\ndata: {"error":{"message":"x"}}\n\n'
    assert dumps({"a": None}) == '{"a":null}'
