"""The output side of the engine: where a request's outputs go (``OutputSink``), how a step's outputs
reach them (``deliver``: one hand-over per event loop per step) and how a stream's tokens are paced.

Design notes: docs/worker.md ("`worker/engine/core.py`").
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from worker.types import ChoiceEnded, CoreOutput, Dequeued, FinishReason, NewToken


class OutputSink(Protocol):
    """Where a request's outputs go: a :class:`RequestStream` on an event loop, or (an engine in its
    own process) a pipe to the serving process (worker/engine/process.py)."""

    key: str

    @property
    def loop(self) -> Any: ...  # its ``call_soon_threadsafe(callback, items)`` takes a step's outputs

    def put(self, outputs: list[CoreOutput]) -> None: ...


def ended_outputs(ended: FinishReason | None) -> list[CoreOutput]:
    """The outputs of a request that its resumed tokens already ended (no step runs for it)."""
    return [Dequeued(time.monotonic(), 0), ChoiceEnded(0, ended or FinishReason.STOP)]


def deliver(batches: Iterable[tuple[OutputSink, list[CoreOutput]]]) -> None:
    """Hands a step's outputs to their streams, waking each event loop once per step (not once per
    request). Called from the engine thread."""
    by_loop: dict[Any, list[tuple[OutputSink, list[CoreOutput]]]] = {}
    for stream, batch in batches:
        by_loop.setdefault(stream.loop, []).append((stream, batch))
    for loop, items in by_loop.items():
        # A closed loop means nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[OutputSink, list[CoreOutput]]]) -> None:
    for stream, batch in items:
        stream.put(batch)


@dataclass
class Pacing:
    """A stream's tokens kept back under ``--stream-interval`` or its request's stream interval."""

    held: list[CoreOutput] = field(default_factory=list)  # the tokens kept back
    held_steps: int = 0  # steps whose tokens ``held`` keeps
    streamed: bool = False  # a token was delivered (the first one is never kept back)
    handed_at: float = 0.0  # when outputs were last handed over (time.monotonic())
    step_at: float = 0.0  # when the last step's outputs came (handed over or kept)


def _plain(outputs: list[CoreOutput]) -> bool:
    """Only tokens that end nothing: what may be kept back."""
    return all(type(o) is NewToken and o.finish is None for o in outputs)


def paced(pacing: Pacing, outputs: list[CoreOutput], interval: int) -> list[CoreOutput] | None:
    """What to deliver of a step's ``outputs`` under a stream interval: None while plain tokens are
    kept back (fewer than ``interval`` steps of them); anything else (a first token, an end, a
    failure, progress) goes out at once with whatever was kept."""
    if pacing.streamed and _plain(outputs):
        pacing.held += outputs
        pacing.held_steps += 1
        if pacing.held_steps < interval:
            return None
        outputs = pacing.held
    elif pacing.held:
        outputs = pacing.held + outputs
    pacing.held, pacing.held_steps = [], 0
    pacing.streamed = pacing.streamed or any(type(o) is NewToken for o in outputs)
    return outputs


def paced_by_time(
    pacing: Pacing, outputs: list[CoreOutput], interval_s: float, now: float
) -> list[CoreOutput] | None:
    """The same as :func:`paced` with a window in seconds (a request's ``stream_interval_ms``):
    plain tokens are kept back while the window has more than a quarter of a step left (a step's
    length: the time since this stream's last one; the quarter absorbs the steps' jitter), so
    hand-overs come at least about ``interval_s`` apart, less than a step more."""
    step_s = now - pacing.step_at if pacing.step_at else 0.0
    pacing.step_at = now
    if pacing.streamed and _plain(outputs) and now - pacing.handed_at < interval_s - step_s / 4:
        pacing.held += outputs
        return None
    if pacing.held:
        outputs = pacing.held + outputs
    pacing.held, pacing.held_steps = [], 0
    pacing.handed_at = now
    pacing.streamed = pacing.streamed or any(type(o) is NewToken for o in outputs)
    return outputs
