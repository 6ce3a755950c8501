"""Merging a stream's pending worker events: several deltas of one choice become one.

When a client reads slower than the model writes (or the edge is busy), a
stream's events wait in its pump (:mod:`edge.streaming.pump`) until the next
write. Consecutive waiting deltas of the same kind for the same choice are
merged into the first one, so the translator makes one chunk of them instead
of one per token. Merging happens on the worker's events, before any surface
translates them, so every surface (OpenAI chat and completions, and any
other) gets it for free and its own chunk rules hold for every chunk: a
merged event is just a delta that carries more text.

The rules (:func:`merge_into`), for an event ``b`` arriving right after a
waiting event ``a`` of the same call:

- ``content`` after ``content``, ``reasoning`` after ``reasoning``,
  ``refusal`` after ``refusal``, same ``choice_index``: the text is appended,
  and the token ids and per-token logprobs are concatenated in order;
- ``tool_call`` after ``tool_call``, same choice and ``tool_index``, and ``b``
  carries no ``id`` and no ``name`` (an arguments fragment): the arguments
  are appended and the token ids concatenated. A delta that starts a call (it carries the id and name) is
  never merged into an earlier one, so the first delta of every call still
  carries them;
- anything else (``started``, ``progress``, ``finished``, ``usage``, other
  choices or kinds) is not merged: the order of kinds and choices is kept.

Merging mutates ``a``; the events are the edge's own copies, read from the
call and not shared.
"""

from __future__ import annotations

from sluice.v1 import worker_pb2

# Event kinds whose consecutive deltas of one choice may merge.
_TEXT_KINDS = frozenset({"content", "reasoning", "refusal"})


def merge_into(waiting: worker_pb2.GenerateResponse, event: worker_pb2.GenerateResponse) -> bool:
    """Merges ``event`` into ``waiting`` when the rules in the module docstring allow it;
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
