"""Named-event framing (Responses, Anthropic, native)."""

from __future__ import annotations

from edge.streaming import sse


def test_named_frame_takes_its_name_from_the_payload_type() -> None:
    frame = sse.named_frame({"type": "message_start", "text": "a\nb"})
    assert frame == b'event: message_start\ndata: {"type":"message_start","text":"a\\nb"}\n\n'
    assert sse.named_frame({"type": "ping"}) == sse.ANTHROPIC_PING_FRAME
