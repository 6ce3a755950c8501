"""The engine process's intake (``--engine-process``): requests prepared (grammars compiled) on a small
pool off the pipe's only reader; an abort or stop that arrives while its request is being prepared is
held and applied in order after it.

Design notes: docs/worker.md ("The engine in its own process").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from worker.engine.core import Engine
from worker.engine.process_messages import Abort, Acked, Refusal, StopChoices
from worker.engine.sink import OutputSink
from worker.errors import GenerationFailed, WorkerError
from worker.types import GenerationRequest

log = logging.getLogger(__name__)

# Requests prepared at once (grammar compiles hold the GIL: more threads would not go faster).
PREPARE_THREADS = 2
# The refusal of a request aborted while it was being prepared (nobody waits for it any more).
ABORTED_WHILE_PREPARED = "generation failed: the request was aborted while it was being prepared"


class Intake:
    """Prepares and queues the serving process's requests in ``engine``; each one's :class:`Acked`
    goes to ``answer`` and its outputs to the sink ``sink(key)`` makes. An abort that arrives while
    its request is prepared keeps it out of the queue (its answer refuses it); a stop applies right
    after it is queued: each request hears its controls in the order a single reader would apply
    them."""

    def __init__(
        self,
        engine: Engine,
        answer: Callable[[Acked], None],
        sink: Callable[[str], OutputSink],
        threads: int = PREPARE_THREADS,
    ):
        self._engine = engine
        self._answer = answer
        self._sink = sink
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="sluice-prepare")
        self._lock = threading.Lock()
        self._preparing: dict[str, list[Abort | StopChoices]] = {}  # key -> what arrived meanwhile

    def submit(self, key: str, request: GenerationRequest) -> None:
        """Starts preparing ``request`` (returns at once)."""
        with self._lock:
            self._preparing[key] = []
        self._pool.submit(self._take_in, key, request)

    def control(self, message: Abort | StopChoices) -> None:
        """Applies an abort or a stop now, or, while its request is being prepared, once that ends."""
        with self._lock:
            held = self._preparing.get(message.key)
            if held is not None:
                held.append(message)
                return
        _apply(self._engine, message)

    def close(self) -> None:
        """Prepares nothing more (the engine stops)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _take_in(self, key: str, request: GenerationRequest) -> None:
        try:
            answer = self._queue(key, request)
        except Exception:  # a bug here must still answer, or the caller waits for ever
            log.exception("queueing %s failed", key)
            answer = Acked(key, Refusal(GenerationFailed, "generation failed: queueing it failed"))
        try:
            self._answer(answer)
        except (OSError, ValueError):
            log.info("the answer to %s could not be sent: the serving process is gone", key)

    def _queue(self, key: str, request: GenerationRequest) -> Acked:
        """Prepares and queues the request, then applies what arrived for it meanwhile, in order."""
        try:
            prepared = self._engine.prepare(request)
        except Exception as error:
            with self._lock:
                self._preparing.pop(key, None)
            return Acked(key, _refusal(key, error))
        with self._lock:  # a control arriving from now on finds the request queued (or refused)
            held = self._preparing.pop(key, [])
            if any(isinstance(message, Abort) for message in held):
                return Acked(key, Refusal(GenerationFailed, ABORTED_WHILE_PREPARED))
            if prepared.ended is not None:
                self._engine.count_ended()
                return Acked(key, ended=prepared.ended)
            try:
                self._engine.enqueue(prepared, key, self._sink(key))
            except Exception as error:
                return Acked(key, _refusal(key, error))
            for message in held:
                _apply(self._engine, message)
        return Acked(key)


def _apply(engine: Engine, message: Abort | StopChoices) -> None:
    match message:
        case Abort(key, failed):
            engine.abort(key, failed=failed)
        case StopChoices(key, choices):
            engine.stop_choices(key, choices)


def _refusal(key: str, error: Exception) -> Refusal:
    """What refused a request: a worker error as it is (QueueFull, InvalidRequest), a bug as a failure."""
    if isinstance(error, WorkerError):
        return Refusal.of(error)
    log.error("preparing or queueing %s failed", key, exc_info=error)
    return Refusal(GenerationFailed, f"generation failed: {type(error).__name__}")
