"""What a failure in the engine's step loop costs: the requests it belongs to, or, where the engine's
state can no longer be trusted, the engine itself (its owner reports NOT_SERVING and exits non-zero).

Design notes: docs/worker.md ("Failure isolation").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from worker.engine import sink
from worker.engine.requests import InFlight, Ledger, Outputs, Owners, RequestState, failed, unique
from worker.engine.scheduler import SchedulingFailed
from worker.model.device import is_fatal_device_error
from worker.model.step_inputs import Work
from worker.types import CoreFailure

log = logging.getLogger(__name__)


class EngineFailure(Exception):
    """The engine cannot go on: every request fails, the step loop ends and the worker exits to be
    restarted (its device failed, its block accounting no longer adds up, or its outputs cannot be
    delivered)."""


class DeviceFailure(EngineFailure):
    """The device failed during a step (:func:`worker.model.device.is_fatal_device_error`): every
    later step would fail too."""


def raise_if_device_failed(error: BaseException) -> None:
    """Raises :class:`DeviceFailure` from ``error`` when it says the device failed; else returns, and
    the caller fails the requests the error belongs to."""
    if is_fatal_device_error(error):
        raise DeviceFailure(f"{type(error).__name__}: {error}") from error


def failure_message(error: BaseException) -> str:
    """What a request failed by ``error`` is told (its type only: details go to the log)."""
    return f"generation failed: {type(error).__name__}"


class _Outputs(Protocol):
    """The update side, as failing requests needs it (:class:`worker.engine.update.Update`)."""

    in_flight: InFlight | None

    def publish(self, states: list[RequestState], outputs: Outputs) -> None: ...


class Containment:
    """What a failure in the step loop costs, decided in one place: it fails the requests it
    belongs to and checks the block accounting, or stops the engine (``failure``), ending every
    request and calling ``on_engine_failure``."""

    def __init__(
        self, ledger: Ledger, outputs: _Outputs, on_engine_failure: Callable[[BaseException], None] | None
    ):
        self._ledger = ledger
        self._outputs = outputs
        self.on_engine_failure = on_engine_failure
        self.failure: EngineFailure | None = None  # what stopped the engine, if anything did

    def planning_failed(self, error: Exception) -> None:
        """Planning raised: every request fails (a scheduler bug: no request's plan can be trusted),
        those whose start raised in that plan (:class:`SchedulingFailed`, out of the queue) too."""
        started = [state for state, _ in error.failed] if isinstance(error, SchedulingFailed) else []
        with self._ledger.cv:
            self._ledger.counters.requests_failed += len(started)  # out of the queue: counted here
            everyone = [*self._ledger.everyone(), *started]
        cause = error.error if isinstance(error, SchedulingFailed) else error
        self.contain(cause, "scheduling" if isinstance(error, SchedulingFailed) else "planning", everyone)

    def start_failed(self, failed: list[tuple[RequestState, Exception]]) -> None:
        """Requests whose start raised: already out of the queue, each fails alone."""
        outputs: Outputs = {}
        with self._ledger.cv:  # already out of the queue, so fail() does not count them
            self._ledger.counters.requests_failed += len(failed)
        for state, error in failed:
            log.error("planning failed for %s: %r", state.key, error)
            self._ledger.fail(state, failure_message(error), outputs)
        self._outputs.publish([state for state, _ in failed], outputs)

    def forward_failed(
        self, error: Exception, work: list[Work], owners: Owners, outputs: Outputs, *, rerun_decodes: bool
    ) -> list[Work]:
        """A failed forward fails its own rows only: a step's prompt chunks' requests when it had
        decode rows too, which are returned to run again on their own if ``rerun_decodes``; else
        every row's."""
        log.error("forward failed", exc_info=error)
        chunks = [w for w in work if w.count > 1]
        decodes = [w for w in work if w.count == 1]
        blamed = chunks if chunks and decodes and rerun_decodes else work
        self.fail_rows(error, blamed, owners, outputs)
        if blamed is work:
            return []
        return [w for w in decodes if not failed(outputs.get(owners[id(w.seq)][0].key, []))]

    def fail_rows(self, error: Exception, work: list[Work], owners: Owners, outputs: Outputs) -> None:
        """Fails the requests of ``work``'s rows with ``error``."""
        for state in unique([owners[id(w.seq)][0] for w in work]):
            self._ledger.fail(state, failure_message(error), outputs)

    def contain(self, error: Exception, where: str, states: list[RequestState]) -> None:
        """Fails ``states`` for ``error`` raised in ``where`` (their draw in flight dropped), then
        checks the block accounting: a failure that left it wrong, or that recurs while failing
        them, stops the engine (:class:`EngineFailure`)."""
        log.error("%s failed; failing %d request(s)", where, len(states), exc_info=error)
        ledger = self._ledger
        with ledger.cv:
            ledger.counters.step_failures += 1
        try:
            self._outputs.in_flight = None
            outputs: Outputs = {}
            for state in states:
                if not state.removed:
                    ledger.fail(state, failure_message(error), outputs)
            self._outputs.publish(states, outputs)
            with ledger.cv:
                running = ledger.scheduler.running
                problem = ledger.scheduler.blocks.audit(
                    c.seq.blocks for s in running for c in s.choices if not c.finished
                )
        except Exception as again:
            ledger.unended += states  # their failure may not have reached them: the last outputs will
            raise EngineFailure(f"failing the requests of {where} failed: {type(again).__name__}") from again
        if problem is not None:
            raise EngineFailure(f"after {where} failed, the KV block accounting is wrong: {problem}")

    def stop(self, failure: EngineFailure) -> None:
        """Ends the loop and fails every request; the owner, told first, reports NOT_SERVING and
        exits (so no caller that hears its request failed can find the worker still serving)."""
        log.critical("the engine cannot go on (%s): failing every request; the engine stops", failure)
        with self._ledger.cv:
            self.failure = failure
            self._ledger.stopping = True
            self._outputs.in_flight = None
        message = (
            "generation failed: the worker's device failed"
            if isinstance(failure, DeviceFailure)
            else "generation failed: the worker's engine failed"
        )
        if self.on_engine_failure is not None:
            self.on_engine_failure(failure)
        self.end_all(message)

    def end_all(self, message: str) -> None:
        """Ends every request the engine holds with ``message`` (the loop is ending), touching neither
        the scheduler's blocks nor anything else that may have failed."""
        everyone = self._ledger.end_all()
        try:
            sink.deliver((state.stream, [CoreFailure(message)]) for state in everyone)
        except Exception:
            log.exception("the engine's last outputs could not be delivered")
