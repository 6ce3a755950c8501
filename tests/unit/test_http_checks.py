"""The HTTP fuzz's stream check (tests/fuzz/http_checks.py) on written streams: OpenAI's chunks end
with ``data: [DONE]``; the Responses surface's named events end with the Response's last event."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from tests.fuzz.http_checks import check_event_stream

SCHEMA = {"type": "object", "properties": {"type": {"type": "string"}}, "required": ["type"]}


def stream(*frames: str) -> Any:
    """A read answer whose body is ``frames``, each one event."""
    return SimpleNamespace(stream_cut_short=False, text="".join(f"{frame}\n\n" for frame in frames))


def named(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}"


def test_a_responses_stream_ends_with_its_last_event_and_no_done() -> None:
    for last in ("response.completed", "response.incomplete", "response.failed"):
        events = [named("response.created"), ": heartbeat", named("response.output_text.delta", delta="a")]
        check_event_stream(stream(*events, named(last)), SCHEMA)


def test_a_responses_stream_cut_before_its_last_event_fails() -> None:
    with pytest.raises(AssertionError, match="ends with"):
        check_event_stream(stream(named("response.created"), named("response.output_text.delta")), SCHEMA)
    with pytest.raises(AssertionError):  # an event whose data names another type
        check_event_stream(stream(named("response.created"), "event: response.completed\ndata: {}"), SCHEMA)


def test_an_openai_stream_still_needs_done() -> None:
    chunk = f"data: {json.dumps({'type': 'chunk'})}"
    check_event_stream(stream(chunk, "data: [DONE]"), SCHEMA)
    with pytest.raises(AssertionError, match=r"no \[DONE\]"):
        check_event_stream(stream(chunk), SCHEMA)
