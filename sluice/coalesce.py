"""The one rule for merging a stream's consecutive deltas, applied where a stream's events wait: in
the worker (the steps a lagging caller has not read, ``worker/output/processor.py``) and in the
edge (the events waiting for the next client write, ``edge/streaming/pump.py``).

Design notes: docs/edge-internals.md, "Coalescing".
"""

from __future__ import annotations

from typing import Any, Final

from sluice.v1 import worker_pb2

#: The delta kinds that merge (the ``GenerateResponse.event`` names), and the fields a merge joins:
#: text concatenated, token ids and logprobs appended (a refusal carries no ids, a tool call no
#: logprobs).
JOINED_FIELDS: Final[dict[str, tuple[str, ...]]] = {
    "content": ("text", "token_ids", "logprobs"),
    "reasoning": ("text", "token_ids", "logprobs"),
    "refusal": ("text", "logprobs"),
    "tool_call": ("arguments", "token_ids"),
}
_TEXT_FIELDS = frozenset({"text", "arguments"})


def mergeable(kind: str, waiting: Any, more: Any) -> bool:
    """Whether delta ``more`` merges into ``waiting``, the delta of the same ``kind`` right before
    it in one call's stream (either side's representation: the worker's ``worker.types`` deltas or
    the ``sluice.v1`` messages).

    They merge when they are of one choice, and, for a tool call, of one call and ``more`` does not
    open a call (it carries no id and no name). A delta without token ids never merges into one
    that carries ids: ids travel on the last delta of their tokens, so a delta with ids says that
    everything before it was delivered (what a migrated stream resumes from).
    """
    fields = JOINED_FIELDS.get(kind)
    if fields is None or waiting.choice_index != more.choice_index:
        return False
    if kind == "tool_call" and (more.tool_index != waiting.tool_index or _opens_call(more)):
        return False
    return "token_ids" not in fields or bool(more.token_ids) or not waiting.token_ids


def joined(kind: str, waiting: Any, more: Any) -> dict[str, Any]:
    """The joined fields of ``waiting`` followed by ``more`` (a :func:`mergeable` pair of immutable
    deltas, whose fields are strings and tuples): build the merged delta from these."""
    return {name: getattr(waiting, name) + getattr(more, name) for name in JOINED_FIELDS[kind]}


def merge_into(waiting: worker_pb2.GenerateResponse, more: worker_pb2.GenerateResponse) -> bool:
    """Merges event ``more`` into ``waiting``, the event right before it in one call's stream, when
    :func:`mergeable` allows; returns whether it did (``waiting`` is unchanged when it did not)."""
    kind = more.WhichOneof("event")
    if kind not in JOINED_FIELDS or kind != waiting.WhichOneof("event"):
        return False
    into, delta = getattr(waiting, kind), getattr(more, kind)
    if not mergeable(kind, into, delta):
        return False
    for name in JOINED_FIELDS[kind]:
        if name in _TEXT_FIELDS:
            setattr(into, name, getattr(into, name) + getattr(delta, name))
        else:
            getattr(into, name).extend(getattr(delta, name))
    return True


def _opens_call(delta: Any) -> bool:
    """A tool-call delta that opens its call: it carries the call's name or id (``id`` on the
    message, ``call_id`` on the worker's delta)."""
    return bool(delta.name or getattr(delta, "id", "") or getattr(delta, "call_id", ""))
