"""The worker's coalescing (worker/output/processor.py ``coalesce``): the shared rule of
sluice/coalesce.py, so what the worker merges before sending reads exactly as what the edge merges
before writing."""

from __future__ import annotations

from sluice.coalesce import merge_into
from sluice.v1 import worker_pb2 as pb
from worker.output.processor import coalesce
from worker.service.convert import event_to_proto
from worker.types import (
    ContentDelta,
    Event,
    Finished,
    FinishReason,
    ReasoningDelta,
    RefusalDelta,
    Timings,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)


def logprob(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id, f"t{token_id}", -0.5 * token_id, b"t", ())


def finished(choice: int = 0) -> Finished:
    return Finished(choice, FinishReason.STOP, 3, "", None, Timings(0.0, 0.0, 0.0))


SEQUENCES: list[list[Event]] = [
    # One choice's text over several steps: one delta.
    [ContentDelta(0, "Hel", (1,), (logprob(1),)), ContentDelta(0, "lo", (2,), (logprob(2),))],
    # Reasoning, then content, then the end: kinds are kept apart, nothing merges past the end.
    [
        ReasoningDelta(0, "think", (1,)),
        ReasoningDelta(0, "ing", (2,)),
        ContentDelta(0, "A", (3,)),
        finished(),
        ContentDelta(0, "B", (4,)),
        Usage(5, 4),
    ],
    # Two choices interleaved: only consecutive deltas of one choice merge.
    [ContentDelta(0, "a"), ContentDelta(1, "b"), ContentDelta(1, "c"), ContentDelta(0, "d")],
    # Tool-call arguments merge into their call's first delta; a new call starts its own.
    [
        ContentDelta(0, "Let me check."),
        ToolCallDelta(0, 0, '{"ci', "call_1", "get_weather", (1,)),
        ToolCallDelta(0, 0, 'ty": "Oslo"}', token_ids=(2,)),
        ToolCallDelta(0, 1, "{", "call_2", "get_time", (3,)),
        ToolCallDelta(0, 1, "}", token_ids=(4,)),
    ],
    # A refusal after a blocked phrase.
    [RefusalDelta(0, "I can't"), RefusalDelta(0, " help."), finished()],
    # A delta whose ids come later (on the tool call) stays apart from the delta with ids before it.
    [ContentDelta(0, "x", (1,)), ContentDelta(0, "y"), ToolCallDelta(0, 0, "{", "c", "f", (2,))],
]


def edge_merged(messages: list[pb.GenerateResponse]) -> list[pb.GenerateResponse]:
    """What the edge's pump makes of the same messages waiting for one write."""
    merged: list[pb.GenerateResponse] = []
    for message in messages:
        if not merged or not merge_into(merged[-1], message):
            merged.append(message)
    return merged


def test_the_worker_merges_exactly_as_the_edge_does() -> None:
    for events in SEQUENCES:
        worker_side = [event_to_proto(e) for e in coalesce(events)]
        edge_side = edge_merged([event_to_proto(e) for e in events])
        assert worker_side == edge_side, events


def test_what_the_worker_merges() -> None:
    tool_calls = coalesce(SEQUENCES[3])
    assert tool_calls == [
        ContentDelta(0, "Let me check."),
        ToolCallDelta(0, 0, '{"city": "Oslo"}', "call_1", "get_weather", (1, 2)),
        ToolCallDelta(0, 1, "{}", "call_2", "get_time", (3, 4)),
    ]
    assert coalesce(SEQUENCES[0]) == [ContentDelta(0, "Hello", (1, 2), (logprob(1), logprob(2)))]
    assert coalesce(SEQUENCES[4])[0] == RefusalDelta(0, "I can't help.")
    held_apart = coalesce(SEQUENCES[5])
    assert [type(e).__name__ for e in held_apart] == ["ContentDelta", "ContentDelta", "ToolCallDelta"]
