"""The one table of how a worker's finish reason is named on each surface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sluice.v1 import worker_pb2

FinishReason = Literal["stop", "length", "tool_calls", "content_filter"]


@dataclass(frozen=True)
class FinishNames:
    """One finish reason in each surface's words; ``incomplete`` is the Responses API's
    ``incomplete_details.reason`` (``None``: the response is complete)."""

    openai: FinishReason
    anthropic: str
    native: str
    incomplete: str | None


_NAMES: dict[int, FinishNames] = {
    worker_pb2.STOP: FinishNames("stop", "end_turn", "stop", None),
    worker_pb2.LENGTH: FinishNames("length", "max_tokens", "max_output_tokens", "max_output_tokens"),
    worker_pb2.TOOL_CALLS: FinishNames("tool_calls", "tool_use", "tool_calls", None),
    worker_pb2.CONTENT_FILTER: FinishNames("content_filter", "refusal", "content_filter", "content_filter"),
}


def finish_names(reason: int) -> FinishNames:
    """The names of a proto ``FinishReason`` (unspecified, or unknown, reads as STOP)."""
    return _NAMES.get(reason, _NAMES[worker_pb2.STOP])


def finish_reason_name(reason: int) -> FinishReason:
    """The OpenAI ``finish_reason`` for a proto ``FinishReason``."""
    return finish_names(reason).openai
