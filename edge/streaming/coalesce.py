"""Merging a stream's pending worker events: several deltas of one choice become one.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

from sluice.v1 import worker_pb2

# Event kinds whose consecutive deltas of one choice may merge.
_TEXT_KINDS = frozenset({"content", "reasoning", "refusal"})


def merge_into(waiting: worker_pb2.GenerateResponse, event: worker_pb2.GenerateResponse) -> bool:
    """Merges ``event`` into ``waiting`` when the rules in docs/edge-internals.md,
    "Coalescing", allow it;
    returns whether it did (``waiting`` is unchanged when it did not)."""
    kind = event.WhichOneof("event")
    if kind != waiting.WhichOneof("event"):
        return False
    if kind in _TEXT_KINDS:
        into = getattr(waiting, kind)
        more = getattr(event, kind)
        if into.choice_index != more.choice_index:
            return False
        into.text += more.text
        if kind != "refusal" and more.token_ids:
            into.token_ids.extend(more.token_ids)
        if more.logprobs:
            into.logprobs.extend(more.logprobs)
        return True
    if kind == "tool_call":
        call, more_call = waiting.tool_call, event.tool_call
        if (
            call.choice_index != more_call.choice_index
            or call.tool_index != more_call.tool_index
            or more_call.id
            or more_call.name
        ):
            return False
        call.arguments += more_call.arguments
        call.token_ids.extend(more_call.token_ids)
        return True
    return False
