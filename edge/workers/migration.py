"""Stream migration: a worker call that dies after its first event goes on, on another worker. Here
the policy and what a moved call resumes from; the move itself is :class:`edge.workers.call.WorkerCall`'s.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from sluice.v1 import worker_pb2

_DELTA_KINDS = frozenset({"content", "reasoning", "tool_call", "refusal"})
# Events of a resumed call that the caller already had from the first call.
_ONCE_PER_REQUEST = frozenset({"started", "progress", "prompt_logprobs"})

#: ``outcome`` label values of the migration counter.
OUTCOMES = ("resumed", "failed", "limit_reached", "not_resumable")


class MigrationMetrics(Protocol):
    """What migration reports (see :class:`edge.metrics.EdgeMetrics`)."""

    def stream_migration(self, outcome: str) -> None: ...


@dataclass(frozen=True)
class MigrationPolicy:
    """Whether and how often a request's calls may move to another worker mid-stream."""

    max_migrations: int
    metrics: MigrationMetrics | None = None

    @property
    def enabled(self) -> bool:
        return self.max_migrations > 0

    def count(self, outcome: str) -> None:
        """Counts one attempt's ``outcome`` (one of :data:`OUTCOMES`)."""
        if self.metrics is not None:
            self.metrics.stream_migration(outcome)


def resumable_request(request: worker_pb2.GenerateRequest) -> bool:
    """Whether a request can be resumed at all: one choice (the worker resumes n == 1 only)."""
    return not request.sampling.HasField("n") or request.sampling.n <= 1


@dataclass
class _Choice:
    """What the caller received of one choice: the token ids, and deltas waiting for their ids."""

    token_ids: list[int] = field(default_factory=list)
    held: list[worker_pb2.GenerateResponse] = field(default_factory=list)
    finished: bool = False


class Delivered:
    """What the caller has received of one call, and what a moved call resumes from: per choice the
    token ids delivered, and the deltas held back until their ids arrive (see the module doc).

    Holding happens only while the call can be resumed: known from its first ``started`` (the first
    event, or later when model-load progress came first).
    """

    def __init__(self, request: worker_pb2.GenerateRequest) -> None:
        self._request = request
        self._choices: dict[int, _Choice] = {}
        self.resumable = False

    @property
    def tokens(self) -> int:
        """Token ids delivered so far, over every choice."""
        return sum(len(c.token_ids) for c in self._choices.values())

    def all_finished(self) -> bool:
        """Every choice seen has sent its ``finished`` (only the call's usage can be missing)."""
        return bool(self._choices) and all(c.finished for c in self._choices.values())

    def track(self, event: worker_pb2.GenerateResponse, resumed: bool) -> list[worker_pb2.GenerateResponse]:
        """Records ``event`` (``resumed``: it comes from a call moved to another worker); returns
        the events the caller may have now, held ones included."""
        kind = event.WhichOneof("event")
        if kind == "started" and not resumed:
            self.resumable = event.started.resumable and resumable_request(self._request)
        if not self.resumable:
            return [event]
        if kind in _DELTA_KINDS:
            delta = getattr(event, kind)
            choice = self._choice(delta.choice_index)
            ids = getattr(delta, "token_ids", ())  # a refusal carries none: `finished` follows it
            if not ids:
                choice.held.append(event)
                return []
            choice.token_ids.extend(ids)
            out, choice.held = [*choice.held, event], []
            return out
        if kind == "finished":
            choice = self._choice(event.finished.choice_index)
            choice.finished = True
            out, choice.held = [*choice.held, event], []
            return out
        if resumed and kind in _ONCE_PER_REQUEST:
            return []
        return [event]

    def release_held(self) -> list[worker_pb2.GenerateResponse]:
        """The held deltas, for a call that ends here (what the caller would have had unmoved)."""
        held = [event for choice in self._choices.values() for event in choice.held]
        for choice in self._choices.values():
            choice.held = []
        return held

    def drop_held(self) -> None:
        """Forgets the held deltas: the worker the call moved to sends them again."""
        for choice in self._choices.values():
            choice.held = []

    def resume_request(self) -> worker_pb2.GenerateRequest:
        """The request again, with the tokens delivered so far; the prompt's logprobs and echo were
        sent once already."""
        request = worker_pb2.GenerateRequest()
        request.CopyFrom(self._request)
        request.return_token_ids = True
        request.echo_prompt = False
        request.sampling.ClearField("prompt_logprobs")
        request.resume.SetInParent()
        del request.resume.choices[:]
        request.resume.choices.add().ids.extend(self._choice(0).token_ids)
        return request

    def _choice(self, index: int) -> _Choice:
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = _Choice()
        return choice
