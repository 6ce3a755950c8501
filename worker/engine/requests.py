"""The requests an engine holds: each one's state (its choices, sink, pacing) and the ``Ledger`` that
queues, fails, finishes and counts them under the engine's lock.

Design notes: docs/worker.md ("`worker/engine/core.py`").
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.engine.prepare import Prepared
from worker.engine.scheduler import Scheduler, SeqState
from worker.engine.sink import OutputSink, Pacing
from worker.engine.speculation import RowSpeculation
from worker.engine.stats import EngineCounters
from worker.sampling.sampler import Draw, SequenceSampling
from worker.types import CoreFailure, CoreOutput, GenerationRequest, Scheduling

# A request still waiting for a slot hears ``queued`` again this often, so a caller's idle
# timer (the edge's --idle-timeout) does not mistake a long queue for a dead worker.
QUEUED_PROGRESS_INTERVAL_S = 2.0

# A batch row belongs to one choice of one request: (engine request key, choice index).
RowKey = tuple[str, int]

# A step's outputs, by request key.
Outputs = dict[str, list[CoreOutput]]


@dataclass
class Choice:
    """The core's view of one choice: its sequence (tokens, KV blocks) and its sampling state."""

    key: RowKey
    index: int
    sampling: SequenceSampling
    seq: SeqState
    acceptance: RowSpeculation = field(default_factory=RowSpeculation)  # its speculation's state

    @property
    def finished(self) -> bool:
        return self.seq.finished


@dataclass
class RequestState:
    """One queued or running request: its choices, where its outputs go, and its progress."""

    key: str
    request: GenerationRequest
    choices: list[Choice]
    stream: OutputSink
    started: bool = False  # started at least once (a preempted request starts again later)
    pacing: Pacing = field(default_factory=Pacing)  # tokens kept back (``stream_interval``)
    removed: bool = False  # out of the scheduler (failed, cancelled or finished)
    preempted: bool = False  # back in the queue after running (until it starts again)

    @classmethod
    def of(cls, prepared: Prepared, key: str, stream: OutputSink, context_length: int) -> RequestState:
        """A prepared request's state. A resumed request's sequence starts with its resumed tokens as
        generated ones: the first forward computes prompt plus those, and samples the next token."""
        req = prepared.request
        prompt = len(req.prompt_token_ids)
        longest = min(prompt + req.sampling.max_tokens, context_length)
        choices = [
            Choice(
                (key, i),
                i,
                sampling,
                SeqState(
                    list(req.prefill_token_ids),
                    prompt,
                    longest,
                    awaits_prompt=i > 0,
                    images=req.images,
                    lora=req.lora,
                ),
            )
            for i, sampling in enumerate(prepared.samplings)
        ]
        return cls(key, req, choices, stream)

    @property
    def request_id(self) -> str:
        return self.key

    @property
    def sequences(self) -> list[SeqState]:
        return [choice.seq for choice in self.choices]

    @property
    def needs_kv(self) -> bool:
        return self.request.sampling.max_tokens > 0

    @property
    def scheduling(self) -> Scheduling:
        return self.request.scheduling

    @property
    def prompt_length(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def done(self) -> bool:
        return all(choice.finished for choice in self.choices)


# A step's sampled rows: each (request, choice).
Rows = list[tuple[RequestState, Choice]]

# Each running sequence's (request, choice), by ``id(seq)``.
Owners = dict[int, tuple[RequestState, Choice]]


@dataclass
class InFlight:
    """A step's draw the host has not read yet: the rows (state, choice) it drew for, where each
    row's placeholder token sits in its sequence, the draw, and the fence to wait on first."""

    rows: Rows
    places: list[int]
    draw: Draw
    ready: Callable[[], None]


class Control(enum.Enum):
    CANCEL = "cancel"  # the caller went away
    FAIL = "fail"  # the request's output processing failed
    STOP = "stop"  # choices ended by a stop string or blocked phrase


def failed(outputs: list[CoreOutput]) -> bool:
    """Whether a request's outputs of this step hold its failure."""
    return any(isinstance(item, CoreFailure) for item in outputs)


def unique(states: list[RequestState]) -> list[RequestState]:
    """``states`` without repeats, in order."""
    return list({id(s): s for s in states}.values())


class Ledger:
    """The requests the scheduler holds and what happens to them (queued, failed, finished,
    cancelled, preempted), with the counters they move, all under the engine's lock ``cv``."""

    def __init__(self, scheduler: Scheduler[RequestState], counters: EngineCounters):
        self.scheduler = scheduler
        self.counters = counters
        self.cv = threading.Condition()
        self.control: list[tuple[str, Control, tuple[int, ...]]] = []
        self.unended: list[RequestState] = []  # failed where their failure could not be delivered
        self.progress_due: dict[str, float] = {}  # waiting request key -> when "queued" went out
        self.stopping = False  # the loop has ended or is ending: nothing more is queued

    def add(self, state: RequestState) -> None:
        """Queues a request (under the lock; raises what :meth:`Scheduler.add` raises)."""
        self.scheduler.add(state)
        self.progress_due[state.key] = time.monotonic()
        self.counters.requests_submitted += 1
        self.counters.prompt_tokens += len(state.request.prompt_token_ids)
        self.cv.notify_all()

    def everyone(self) -> list[RequestState]:
        """Every request the scheduler holds, waiting or running (under the lock)."""
        return [*self.scheduler.waiting, *self.scheduler.running]

    def finish(self, seq: SeqState) -> None:
        """A choice's sequence ended (its blocks go back)."""
        with self.cv:
            self.scheduler.finish(seq)

    def fail(self, state: RequestState, message: str, outputs: Outputs) -> None:
        """Ends one request with a failure: out of the scheduler, its blocks freed."""
        with self.cv:
            removed = self.scheduler.remove(state.key)
            state.removed = True
            self.progress_due.pop(state.key, None)
            if removed is not None:
                self.counters.requests_failed += 1
            for choice in state.choices:
                if not choice.finished:
                    self.scheduler.finish(choice.seq)
        outputs.setdefault(state.key, []).append(CoreFailure(message))

    def retire(self, states: list[RequestState]) -> None:
        """Takes out requests whose every choice ended, counting each as finished."""
        if not states:
            return
        with self.cv:
            for state in states:
                self.progress_due.pop(state.key, None)
                state.removed = True
                if self.scheduler.remove(state.key) is not None:
                    self.counters.requests_finished += 1

    def preempted(self, states: list[RequestState]) -> None:
        """Requests sent back to the queue: they hear ``queued`` while waiting."""
        now = time.monotonic()
        with self.cv:
            self.counters.preemptions += len(states)
            for state in states:
                self.progress_due[state.key] = now
                state.preempted = True

    def end_all(self) -> list[RequestState]:
        """Takes out every request (the loop is ending), touching no blocks; returns them and those
        whose failure could not be delivered."""
        with self.cv:
            self.stopping = True
            held = self.everyone()
            self.counters.requests_failed += len(held)
            everyone = unique([*held, *self.unended])
            for state in everyone:
                state.removed = True
            self.scheduler.waiting.clear()
            self.scheduler.running.clear()
        return everyone

    def queued_progress_due(self) -> list[RequestState]:
        """Waiting requests whose last ``queued`` event is older than the interval (under the lock)."""
        now = time.monotonic()
        due = [
            s
            for s in self.scheduler.waiting
            if now - self.progress_due.get(s.key, now) >= QUEUED_PROGRESS_INTERVAL_S
        ]
        for state in due:
            self.progress_due[state.key] = now
        return due

    def apply_control(self) -> None:
        """Applies aborts and text-level stops (under the lock)."""
        control, self.control = self.control, []
        for key, kind, choices in control:
            if kind is Control.STOP:
                self._stop(key, choices)
                continue
            removed = self.scheduler.remove(key)
            self.progress_due.pop(key, None)
            if removed is not None:
                removed.removed = True
                if kind is Control.FAIL:
                    self.counters.requests_failed += 1
                else:
                    self.counters.requests_cancelled += 1

    def _stop(self, key: str, choices: tuple[int, ...]) -> None:
        """Ends a request's stopped choices, running or waiting (a preempted request hears its stop
        too), and the request once none is left."""
        queues = (self.scheduler.running, self.scheduler.waiting)
        state = next((s for q in queues for s in q if s.key == key), None)
        if state is None:
            return
        for choice in state.choices:
            if choice.index in choices and not choice.finished:
                self.scheduler.finish(choice.seq)
        if state.done:
            self.scheduler.remove(key)
            state.removed = True
            self.progress_due.pop(key, None)
            self.counters.requests_finished += 1
