"""Stream migration: a worker call that dies after its first event goes on, on another worker.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from edge.errors import EdgeError, ServiceUnavailableError
from edge.workers.pool import GenerateStream, WorkerPool
from sluice.v1 import worker_pb2

log = logging.getLogger("sluice.edge")

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


def resumable_request(request: worker_pb2.GenerateRequest) -> bool:
    """Whether a request can be resumed at all: one choice (the worker resumes n == 1 only)."""
    return not request.sampling.HasField("n") or request.sampling.n <= 1


@dataclass
class _Choice:
    """What the caller received of one choice: the token ids, and deltas waiting for their ids."""

    token_ids: list[int] = field(default_factory=list)
    held: list[worker_pb2.GenerateResponse] = field(default_factory=list)
    finished: bool = False


class ResumableStream:
    """A :class:`GenerateStream` that survives its worker's death (same interface: ``first``,
    iterate once, ``cancel``); see docs/edge-internals.md, "Stream migration".

    ``deadline`` is the request's total deadline (``time.monotonic()`` clock): no new call opens
    after it.
    """

    def __init__(
        self,
        pool: WorkerPool,
        stream: GenerateStream,
        request: worker_pb2.GenerateRequest,
        *,
        request_id: str,
        deadline: float,
        metadata: Sequence[tuple[str, str | bytes]],
        policy: MigrationPolicy,
    ) -> None:
        self._pool = pool
        self._stream = stream
        self._first_stream = stream
        self._request = request
        self._request_id = request_id
        self._deadline = deadline
        self._metadata = tuple(metadata)
        self._policy = policy
        self.first = stream.first
        self.migrations = 0
        self._choices: dict[int, _Choice] = {}
        self._cancelled = False
        # Deltas are held for their ids only when the call can be resumed at all: known from the
        # first call's `started` (its first event, or later when model-load progress came first).
        self._resumable = False

    @property
    def worker_address(self) -> str:
        """The address of the worker serving the call now."""
        return self._stream.worker_address

    @property
    def worker_id(self) -> str:
        """The id of the worker that accepted the call (what the response headers name), even after
        the call moved."""
        return self._first_stream.worker_id

    def cancel(self) -> None:
        """Cancels the current call (idempotent); a migration in progress stops too."""
        self._cancelled = True
        self._stream.cancel()

    def __aiter__(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        return self._events()

    async def _events(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        resumed = False
        try:
            while True:
                try:
                    async for event in self._stream:
                        for out in self._track(event, resumed):
                            yield out
                except EdgeError as error:
                    outcome = await self._migrate(error)
                    if outcome == "resumed":
                        resumed = True
                        continue
                    for out in self._release_held():  # what the caller would have had before
                        yield out
                    if outcome == "ended":
                        return
                    raise
                for out in self._release_held():  # a well-behaved worker leaves none held
                    yield out
                return
        finally:
            self._stream.cancel()

    def _release_held(self) -> list[worker_pb2.GenerateResponse]:
        held = [event for choice in self._choices.values() for event in choice.held]
        for choice in self._choices.values():
            choice.held = []
        return held

    def _track(self, event: worker_pb2.GenerateResponse, resumed: bool) -> list[worker_pb2.GenerateResponse]:
        """Records ``event``; returns the events the caller may have now (held ones included)."""
        kind = event.WhichOneof("event")
        if kind == "started" and not resumed:
            self._resumable = event.started.resumable and resumable_request(self._request)
        if not self._resumable:
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

    def _choice(self, index: int) -> _Choice:
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = _Choice()
        return choice

    async def _migrate(self, error: EdgeError) -> str | None:
        """Tries to continue after ``error``: "resumed" when a new call now serves the request (in
        ``self._stream``), "ended" when the failed call had nothing left but its usage, None when
        ``error`` stands."""
        if not isinstance(error, ServiceUnavailableError) or self._cancelled:
            return None  # not a worker failure (or the caller is gone)
        failed_at = self._stream.worker_address
        if self._resumable and self._choices and all(c.finished for c in self._choices.values()):
            log.info(
                "request %s: worker %s failed after the last choice finished", self._request_id, failed_at
            )
            return "ended"
        if not self._resumable:
            self._count("not_resumable")
            return None
        if self.migrations >= self._policy.max_migrations:
            self._count("limit_reached")
            log.warning(
                "request %s: worker %s failed mid-stream; not moved (already moved %d times)",
                self._request_id,
                failed_at,
                self.migrations,
            )
            return None
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            return None
        request = self._resume_request()
        try:
            stream = await self._pool.generate(request, self._request_id, remaining, self._metadata)
        except EdgeError as refused:
            self._count("failed")
            log.warning(
                "request %s: worker %s failed mid-stream and no worker took the rest (%s: %s)",
                self._request_id,
                failed_at,
                refused.type,
                refused.message,
            )
            return None
        if (
            self._cancelled
            or stream.first.WhichOneof("event") != "started"
            or not stream.first.started.resumable
        ):
            stream.cancel()  # the caller went away meanwhile, or the worker would restart from scratch
            self._count("failed")
            return None
        for choice in self._choices.values():
            choice.held = []  # the new worker sends these again
        self.migrations += 1
        self._stream = stream
        self._count("resumed")
        sent = sum(len(c.token_ids) for c in self._choices.values())
        log.warning(
            "request %s: worker %s failed mid-stream; moved to %s after %d tokens",
            self._request_id,
            failed_at,
            stream.worker_address,
            sent,
        )
        return "resumed"

    def _resume_request(self) -> worker_pb2.GenerateRequest:
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

    def _count(self, outcome: str) -> None:
        if self._policy.metrics is not None:
            self._policy.metrics.stream_migration(outcome)
