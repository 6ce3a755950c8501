"""The pooling engine (``--task embed|score``): a step loop thread that batches the queued requests'
inputs, prompt-only with no KV cache, under the same step budgets as generation; thread-safe
``submit`` returning an awaitable, ``stats``. Design notes: docs/worker.md, "Embeddings and scores".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from worker.engine.stats import EngineCounters, EngineStats
from worker.errors import GenerationFailed, QueueFull
from worker.model.device import bind_device, is_fatal_device_error
from worker.model.pooling_runner import PoolingInput, PoolingRunner

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Job:
    """One request: its inputs, the rows computed so far, and the future its caller awaits."""

    key: str
    inputs: list[PoolingInput]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[torch.Tensor]
    rows: list[torch.Tensor | None] = field(default_factory=list)
    next_input: int = 0  # the first input no step has taken yet

    def __post_init__(self) -> None:
        self.rows = [None] * len(self.inputs)


class PoolingEngine:
    """Batches pooling requests over one :class:`PoolingRunner`. ``start`` once; ``submit`` from an
    event loop. A step takes queued inputs in arrival order (a large request's inputs may span steps)
    while they fit ``max_rows`` rows and ``budget_tokens`` padded tokens (a longer input runs alone)."""

    def __init__(
        self,
        runner: PoolingRunner,
        *,
        max_rows: int = 32,
        max_queue: int = 256,
        budget_tokens: int = 1024,
        on_device_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        """``on_device_failure`` is called (on the loop thread) once the device failed; the loop ends."""
        self._runner = runner
        self._on_device_failure = on_device_failure
        self._max_rows = max_rows
        self._max_queue = max_queue
        self._budget = budget_tokens
        self._queue: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="sluice-pooling", daemon=True)
        self.counters = EngineCounters()
        self.device_failure: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, key: str, inputs: list[PoolingInput]) -> asyncio.Future[torch.Tensor]:
        """Queues one request's inputs (at least one); the future resolves to their rows, one per input
        (``PoolingRunner.forward``'s), or fails with :class:`GenerationFailed`. Cancelling it drops the
        inputs no step has taken. Raises :class:`QueueFull` when ``max_queue`` requests wait."""
        loop = asyncio.get_running_loop()
        job = _Job(key, list(inputs), loop, loop.create_future())
        with self._cv:
            if len(self._queue) >= self._max_queue:
                raise QueueFull(
                    f"the worker's queue is full ({self._max_queue} requests waiting); retry later",
                    retry_after_seconds=1.0,
                )
            self._queue.append(job)
            self.counters.requests_submitted += 1
            self.counters.prompt_tokens += sum(len(item.token_ids) for item in inputs)
            self._cv.notify_all()
        return job.future

    def stats(self) -> EngineStats:
        with self._cv:
            return EngineStats(
                waiting_requests=len(self._queue),
                running_requests=0,
                running_sequences=0,
                live_caches=0,
                cache_tokens=0,
                cache_bytes=0,
                reserved_tokens=0,
                counters=replace(self.counters, time_to_first_token=self.counters.time_to_first_token.copy()),
            )

    def latest_stats(self) -> EngineStats:
        """What ``/metrics`` reads: :meth:`stats` (this engine's lock is held only to plan a step and to
        count, never across a forward, so a scrape does not wait for a step)."""
        return self.stats()

    # --------------------------------------------------------------- loop

    def _plan(self) -> list[tuple[_Job, int]] | None:
        """The next step's (job, input index) rows, under the lock; None once stopping."""
        with self._cv:
            while not self._stopping and not self._queue:
                self._cv.wait()
            if self._stopping:
                return None
            rows: list[tuple[_Job, int]] = []
            longest = 0
            for job in list(self._queue):
                if job.future.cancelled():
                    self._queue.remove(job)
                    self.counters.requests_cancelled += 1
                    continue
                while job.next_input < len(job.inputs) and len(rows) < self._max_rows:
                    length = len(job.inputs[job.next_input].token_ids)
                    if rows and max(longest, length) * (len(rows) + 1) > self._budget:
                        return rows
                    rows.append((job, job.next_input))
                    longest = max(longest, length)
                    job.next_input += 1
                if len(rows) >= self._max_rows:
                    break
            return rows

    def _loop(self) -> None:
        bind_device(self._runner.device)
        while (rows := self._plan()) is not None:
            if rows:
                self._step(rows)

    def _step(self, rows: list[tuple[_Job, int]]) -> None:
        started = time.monotonic()
        self.counters.steps += 1
        try:
            output = self._runner.forward([job.inputs[index] for job, index in rows])
        except Exception as exc:
            fatal = is_fatal_device_error(exc)
            log.log(logging.CRITICAL if fatal else logging.ERROR, "pooling forward failed", exc_info=exc)
            failed = list({id(job): job for job, _ in rows}.values())
            if fatal:
                with self._cv:
                    self.device_failure, self._stopping = exc, True
                    failed = list({id(job): job for job in [*failed, *self._queue]}.values())
            if fatal and self._on_device_failure is not None:
                self._on_device_failure(exc)  # first: no caller may hear of its failure while serving
            self._finish(failed, f"the forward pass failed: {type(exc).__name__}")
            return
        done: list[_Job] = []
        for (job, index), row in zip(rows, output, strict=True):
            job.rows[index] = row
            if index == len(job.inputs) - 1 and all(r is not None for r in job.rows):
                done.append(job)
        log.debug("pooling step: %d rows in %.3f s", len(rows), time.monotonic() - started)
        self._finish(done, None)

    def _finish(self, jobs: list[_Job], error: str | None) -> None:
        with self._cv:
            for job in jobs:
                with contextlib.suppress(ValueError):
                    self._queue.remove(job)
                if error is None:
                    self.counters.requests_finished += 1
                else:
                    self.counters.requests_failed += 1
        for job in jobs:
            outcome = torch.stack([r for r in job.rows if r is not None]) if error is None else None
            with contextlib.suppress(RuntimeError):  # the caller's loop is gone: nobody is waiting
                job.loop.call_soon_threadsafe(_settle, job.future, outcome, error)


def _settle(future: asyncio.Future[torch.Tensor], rows: torch.Tensor | None, error: str | None) -> None:
    if future.done():
        return
    if rows is not None:
        future.set_result(rows)
    else:
        future.set_exception(GenerationFailed(f"pooling failed: {error}"))
