"""Token usage of one HTTP response, which may span several worker calls.

:class:`UsageTracker` sums the calls' events (running usage for continuous usage
stats, the final total); the shape is OpenAI's ``usage`` (docs/http.md, "Usage").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edge.requests.models import ResponseModel
from sluice.v1 import worker_pb2


def usage_dict(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0
) -> dict[str, Any]:
    """OpenAI ``usage`` with the cached and reasoning token details."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }


@dataclass
class _Call:
    prompt_tokens: int = 0
    usage: worker_pb2.Usage | None = None
    # Per choice of this call: tokens counted from deltas, and the finished count.
    counted: dict[int, int] = field(default_factory=dict)
    finished: dict[int, int] = field(default_factory=dict)
    reasoning: int = 0

    def completion_so_far(self) -> int:
        choices = self.counted.keys() | self.finished.keys()
        return sum(self.finished.get(c, self.counted.get(c, 0)) for c in choices)


@dataclass
class UsageTracker:
    """Usage accounting for one response (docs/edge-internals.md, "Usage accounting").

    ``call`` is the index of the worker call an event came from (always 0 for
    chat; the prompt's index for a multi-prompt completion).
    """

    _calls: dict[int, _Call] = field(default_factory=dict)

    def on_event(self, call: int, event: worker_pb2.GenerateResponse, kind: str | None = None) -> None:
        """Records one event of worker call ``call``.

        ``kind`` is ``event.WhichOneof("event")`` when the caller has it already
        (this runs once per streamed token, so the lookup is not repeated).
        """
        state = self._calls.get(call)
        if state is None:
            state = self._calls[call] = _Call()
        if kind is None:
            kind = event.WhichOneof("event")
        if kind == "content":  # the most frequent event first
            delta = event.content
            ids = delta.token_ids
            if ids:  # only present when continuous usage asked the worker for them
                index = delta.choice_index
                state.counted[index] = state.counted.get(index, 0) + len(ids)
        elif kind == "started":
            state.prompt_tokens = event.started.prompt_tokens
        elif kind == "reasoning":
            index, count = event.reasoning.choice_index, len(event.reasoning.token_ids)
            state.counted[index] = state.counted.get(index, 0) + count
            state.reasoning += count
        elif kind == "finished":
            state.finished[event.finished.choice_index] = event.finished.completion_tokens
        elif kind == "usage":
            state.usage = event.usage

    def running(self) -> dict[str, Any]:
        """Usage so far: prompt tokens of the calls started, completion tokens counted or finished."""
        calls = self._calls.values()
        return usage_dict(
            sum(c.prompt_tokens for c in calls),
            sum(c.completion_so_far() for c in calls),
            sum(c.usage.cached_tokens for c in calls if c.usage is not None),
            sum(c.reasoning for c in calls),
        )

    def final(self) -> dict[str, Any]:
        """The total once every call ended: each call's usage event (or, if it sent none,
        its started prompt tokens and finished counts), summed."""
        prompt = completion = cached = reasoning = 0
        for call in self._calls.values():
            if call.usage is not None:
                prompt += call.usage.prompt_tokens
                completion += call.usage.completion_tokens
                cached += call.usage.cached_tokens
                reasoning += call.usage.reasoning_tokens
            else:
                prompt += call.prompt_tokens
                completion += call.completion_so_far()
                reasoning += call.reasoning
        return usage_dict(prompt, completion, cached, reasoning)


class PromptTokensDetails(ResponseModel):
    cached_tokens: int


class CompletionTokensDetails(ResponseModel):
    reasoning_tokens: int


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails
