"""Worker health: a background loop checks every worker (grpc.health.v1) when due and re-resolves
DNS; a worker that fails a check or a call is ejected and re-checked after a backoff, and taken
back at its first SERVING answer. docs/edge-internals.md, "The worker pool".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Sequence

import grpc

from edge.errors import ServiceUnavailableError
from edge.workers.failures import WORKER_FAULTS_TO_EJECT, CallFailure, classify
from edge.workers.membership import ClientFactory, Membership, Resolver
from edge.workers.worker import MODEL_LOADING_REASON, Worker, WorkerStatus, eject_backoff_s
from sluice.client import WORKER_SERVICE, ServingStatus, WorkerCallError

log = logging.getLogger("sluice.edge")

_JITTER = 0.2
NO_WORKER_MESSAGE = "No model worker is available; please retry later."


class HealthChecks(Membership):
    """Membership plus health: checks, ejection and restoration, and the loop that runs them.
    The loop starts with :meth:`open` (or on first use) and stops with :meth:`close`."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        health_timeout_s: float,
        health_interval_s: float,
        dns_name: str | None,
        dns_refresh_interval_s: float,
        client_factory: ClientFactory,
        resolver: Resolver,
    ) -> None:
        super().__init__(
            addresses,
            dns_name=dns_name,
            dns_timeout_s=health_timeout_s * 2,
            client_factory=client_factory,
            resolver=resolver,
        )
        self._health_timeout_s = health_timeout_s
        self._health_interval_s = health_interval_s
        self._dns_refresh_interval_s = dns_refresh_interval_s
        self._task: asyncio.Task[None] | None = None
        self._first_round: asyncio.Event | None = None
        self._closed = False

    def note_call_failure(self, worker: Worker, error: WorkerCallError) -> None:
        """Counts a failed call against ``worker`` as :func:`edge.workers.failures.classify` says:
        UNAVAILABLE (down, draining or loading) ejects it now; INTERNAL, UNKNOWN or DATA_LOSS
        eject it at the :data:`~edge.workers.failures.WORKER_FAULTS_TO_EJECT`-th in a row; any
        other status (client errors, RESOURCE_EXHAUSTED, CANCELLED, a request's own deadline)
        is not the worker's fault and changes nothing."""
        failure = classify(error.code())
        if failure == CallFailure.DOWN:
            if error.reason == MODEL_LOADING_REASON:
                worker.load_fraction = error.status.load_fraction
                self._eject(worker, WorkerStatus.LOADING, error.message)
                return
            draining = error.reason == "not_ready"
            self._eject(
                worker, WorkerStatus.NOT_SERVING if draining else WorkerStatus.UNREACHABLE, error.message
            )
        elif failure == CallFailure.WORKER_FAULT:
            worker.worker_faults += 1
            if worker.worker_faults >= WORKER_FAULTS_TO_EJECT:
                worker.worker_faults = 0
                why = f"{WORKER_FAULTS_TO_EJECT} failed calls in a row, the last {error.code().name}"
                self._eject(worker, WorkerStatus.UNREACHABLE, why)

    def note_call_success(self, worker: Worker) -> None:
        """A call on ``worker`` completed: its run of worker faults is over."""
        worker.worker_faults = 0

    def _eject(self, worker: Worker, status: WorkerStatus, why: str) -> None:
        now = time.monotonic()
        was_available = worker.available
        worker.status = status
        worker.models = None  # it may come back serving something else
        worker.failures += 1
        backoff = eject_backoff_s(worker.failures, self._health_interval_s, random.uniform(-_JITTER, _JITTER))
        worker.next_check_at = now + backoff
        if was_available and not worker.removed:
            log.warning(
                "worker %s ejected (%s: %s); re-checking in %.1f s", worker.address, status, why, backoff
            )
        self._poke()

    def _restore(self, worker: Worker) -> None:
        if worker.status != WorkerStatus.SERVING and not worker.removed:
            again = "" if worker.status == WorkerStatus.UNKNOWN else " again (taken back)"
            log.info("worker %s is serving%s", worker.address, again)
        worker.status = WorkerStatus.SERVING
        worker.load_fraction = None
        worker.failures = 0
        worker.next_check_at = time.monotonic() + self._health_interval_s

    def _none_available(self) -> ServiceUnavailableError:
        """503 for 'every worker is known down'; Retry-After is the next re-check (1 s at least)."""
        now = time.monotonic()
        soonest = min((w.next_check_at for w in self._workers.values() if not w.removed), default=now)
        retry = min(max(1.0, soonest - now), max(1.0, self._health_interval_s))
        return ServiceUnavailableError(NO_WORKER_MESSAGE, retry_after=retry)

    def open(self) -> None:
        """Creates the channels, starts connecting and starts the discovery/health loop.

        Optional (also done on first use); must run inside the serving loop.
        """
        self._ensure_started()
        for worker in self._workers.values():
            worker.client.connect()

    def _ensure_started(self) -> None:
        if self._task is None and not self._closed:
            self._wake = asyncio.Event()
            self._first_round = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sluice-worker-pool")

    async def close(self) -> None:
        """Stops the background loop and closes every channel, cancelling calls still open."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        workers = list(self._workers.values())
        await asyncio.gather(*(w.client.close() for w in workers), return_exceptions=True)

    async def wait_first_round(self) -> None:
        """Waits (bounded) until the first discovery and health round ended, so a caller
        sees checked states rather than UNKNOWN right after start-up."""
        self._ensure_started()
        if self._first_round is None:
            return
        # A check may ask twice (named service, then ""); DNS gets the same again.
        bound = 3 * self._health_timeout_s + 0.5
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(bound):
                await self._first_round.wait()

    async def _run(self) -> None:
        """Discovery and health: resolve when due, check every worker that is due, sleep until
        the next thing is due (or a call ejects a worker), repeat."""
        assert self._wake is not None and self._first_round is not None  # set by _ensure_started
        next_dns_at = 0.0
        while True:
            try:
                if self._dns is not None and time.monotonic() >= next_dns_at:
                    await self._refresh_dns()
                    next_dns_at = time.monotonic() + self._dns_refresh_interval_s
                self._wake.clear()
                now = time.monotonic()
                due = [w for w in self._workers.values() if not w.removed and w.next_check_at <= now]
                await asyncio.gather(*(self._check(w) for w in due))
                await self._close_removed()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stop health checking for good
                log.exception("worker pool loop failed; continuing")
                await asyncio.sleep(1.0)
            self._first_round.set()
            wake_at = min(
                (w.next_check_at for w in self._workers.values() if not w.removed), default=math.inf
            )
            if self._dns is not None:
                wake_at = min(wake_at, next_dns_at)
            delay = max(0.0, min(wake_at - time.monotonic(), 3600.0))
            # asyncio.timeout, not wait_for (here and above): wait_for (3.11) swallows a
            # cancellation that arrives as the awaited thing completes.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()

    async def _check(self, worker: Worker) -> None:
        """One health check: SERVING restores the worker, anything else ejects it."""
        try:
            try:
                status = await worker.client.health(WORKER_SERVICE, timeout=self._health_timeout_s)
            except WorkerCallError as error:
                if error.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                # This server does not register the named service: ask about the server.
                status = await worker.client.health("", timeout=self._health_timeout_s)
        except WorkerCallError as error:
            self._eject(worker, WorkerStatus.UNREACHABLE, f"health check {error.code().name}")
            await self._fresh_channel_if_backing_off(worker)
            return
        if status == ServingStatus.SERVING:
            self._restore(worker)
        elif not await self._learn_loading(worker):
            self._eject(worker, WorkerStatus.NOT_SERVING, f"health check answered {status}")

    async def _learn_loading(self, worker: Worker) -> bool:
        """After a NOT_SERVING answer: asks ``worker`` (ListModels) whether it is loading its
        model; if so, marks it LOADING with its load fraction and returns True. Health checking
        has one NOT_SERVING for "loading" and "draining"; only a loading worker is worth a
        request that can wait."""
        try:
            await worker.client.list_models(timeout=self._health_timeout_s)
        except WorkerCallError as error:
            if error.reason == MODEL_LOADING_REASON:
                self.note_call_failure(worker, error)
                return True
        return False

    async def _fresh_channel_if_backing_off(self, worker: Worker) -> None:
        """Drops ``worker``'s channel when it is waiting out gRPC's reconnect backoff, so the
        next check opens a fresh one that connects at once.

        Why: an unreachable worker's channel retries on gRPC's own schedule, which backs off
        (up to ``max_reconnect_backoff_ms``); a check made meanwhile fails at once without
        trying. With a fresh channel per re-check, a restarted worker is found by the first
        re-check after it answers, so the pool's re-check schedule (at most
        ``health_interval_s``, jittered) alone bounds how long it waits to be taken back,
        however long the outage was. Only an idle worker's channel is dropped: closing a
        channel cancels its calls.
        """
        if worker.outstanding == 0 and worker.client.backing_off():
            await worker.client.close()
