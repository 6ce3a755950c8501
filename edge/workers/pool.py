"""The edge's workers: discovery, health, ejection, choice by load, and Generate calls.

Workers come from a static address list and/or a DNS name (a Kubernetes
headless service), re-resolved every ``dns_refresh_interval_s`` seconds with
``loop.getaddrinfo``; each resolved address is its own worker with its own
channel (a :class:`sluice.client.WorkerClient`, the one owner of channel
creation and channel settings). An address that leaves the DNS answer takes
no new calls and is closed once its last call ends; a failed resolution keeps
the current set (a DNS hiccup must not empty the pool).

Health: a background loop asks every worker grpc.health.v1 ``Check``
(``sluice.v1.Worker``, else ``""``) every ``health_interval_s`` seconds. A
worker that answers anything but SERVING, does not answer, or fails a call
with UNAVAILABLE (or does not accept one within ``connect_timeout_s``) is
*ejected*: it gets no calls and is re-checked after a backoff (0.5 s, then
doubling, at most ``health_interval_s``, jittered), and taken back as soon as
a check answers SERVING. Each re-check of an unreachable worker uses a fresh
channel when the old one is waiting out gRPC's reconnect backoff, so a worker
restarted after a long outage is taken back at the first re-check after it
answers (within ``health_interval_s`` plus jitter), not after the channel's
backoff. A worker not checked yet is tried (start-up must not refuse requests
while the first checks run). Only failures that are the worker's count
(:mod:`edge.workers.failures`): UNAVAILABLE ejects at once; INTERNAL, UNKNOWN
and DATA_LOSS eject after a few in a row; client errors and
RESOURCE_EXHAUSTED (back-pressure) never do, so a storm of bad requests
cannot eject the fleet.

Choice (``routing``, :mod:`edge.workers.routing`): the available worker with the
fewest outstanding calls, ties broken round-robin; with ``prefix-affinity``
the worker that served the request's longest known prompt prefix goes
first, unless the load is unbalanced. A request may move to another worker only before its first
event: a call that fails with UNAVAILABLE (worker down, starting or
draining) or RESOURCE_EXHAUSTED (queue full), or that does not send its first
event within ``connect_timeout_s``, is retried on the next worker. Once an
event arrived the request stays where it is. When no worker is available the
request fails at once with 503 and ``Retry-After`` (no connect timeout is
spent on workers known to be down).

The background loop starts with :meth:`WorkerPool.open` (or on first use) and
stops with :meth:`WorkerPool.close`. Use one pool inside one event loop.
Every gRPC failure leaves this module as an :class:`~edge.errors.EdgeError`
(via :func:`edge.errors.from_grpc`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import math
import random
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc

from edge.errors import EdgeError, ServiceUnavailableError, from_grpc
from edge.workers.failures import WORKER_FAULTS_TO_EJECT, CallFailure, classify
from edge.workers.routing import PrefixAffinity, RoutingPolicy, prefix_blocks
from sluice.client import WORKER_SERVICE, GenerateCall, ServingStatus, WorkerCallError, WorkerClient
from sluice.v1 import worker_pb2

log = logging.getLogger("sluice.edge")

_RETRY_BEFORE_FIRST_EVENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
# First re-check of an ejected worker; doubles per failure up to the health interval.
EJECT_BACKOFF_INITIAL_S = 0.5
_JITTER = 0.2
NO_WORKER_MESSAGE = "No model worker is available; please retry later."
# The worker's status-details reason for "still loading its model" (worker.errors.ModelLoading).
MODEL_LOADING_REASON = "model_loading"

Resolver = Callable[[str, int], Awaitable[list[str]]]
ClientFactory = Callable[[str], WorkerClient]


class WorkerStatus(enum.StrEnum):
    """A worker's state in the pool. Only UNKNOWN (not checked yet) and SERVING take calls."""

    UNKNOWN = "UNKNOWN"
    SERVING = "SERVING"
    NOT_SERVING = "NOT_SERVING"  # answered, but not serving (draining, or an older worker loading)
    LOADING = "LOADING"  # answered: still loading its model (takes calls that may wait for it)
    UNREACHABLE = "UNREACHABLE"  # no answer: down, or the network
    REMOVED = "REMOVED"  # left the DNS answer; closed once its calls end


def _is_model_load(event: worker_pb2.GenerateResponse | None) -> bool:
    return (
        event is not None
        and event.WhichOneof("event") == "progress"
        and event.progress.stage == worker_pb2.Progress.MODEL_LOAD
    )


def eject_backoff_s(failures: int, cap_s: float, jitter: float = 0.0) -> float:
    """Seconds until an ejected worker's next check after ``failures`` consecutive failures
    (>= 1): 0.5, 1, 2, ... capped at ``cap_s``, times ``1 + jitter`` (jitter in [-0.2, 0.2]
    spreads the checks of many edges)."""
    base = min(max(cap_s, EJECT_BACKOFF_INITIAL_S), EJECT_BACKOFF_INITIAL_S * 2 ** min(failures - 1, 30))
    return base * (1.0 + jitter)


def split_host_port(name: str) -> tuple[str, int]:
    """``host:port`` (IPv6 as ``[::1]:port``) → (host without brackets, port); ValueError if bad."""
    host, sep, port = name.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name!r} is not host:port")
    return host.removeprefix("[").removesuffix("]"), int(port)


def format_address(ip: str, port: int) -> str:
    """An address gRPC accepts: IPv6 literals are bracketed."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


async def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (A and AAAA), as sorted ``ip:port`` strings.
    Raises ``OSError`` (``socket.gaierror``) when the name does not resolve."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({format_address(str(info[4][0]), port) for info in infos})


class _Worker:
    """One worker address: its client (channel), health state and live counters."""

    def __init__(self, address: str, client: WorkerClient, *, static: bool) -> None:
        self.address = address
        self.client = client
        # Static workers (--workers) stay forever; DNS ones leave with their address.
        self.static = static
        self.outstanding = 0
        self.status = WorkerStatus.UNKNOWN
        self.removed = False
        # Consecutive failures (checks or calls) since the last SERVING answer.
        self.failures = 0
        # INTERNAL/UNKNOWN/DATA_LOSS answers since the last call that completed (edge.workers.failures).
        self.worker_faults = 0
        self.next_check_at = 0.0  # monotonic; 0 = due now
        # The worker's own id (``started.worker_id``), learned from its answers.
        self.worker_id: str | None = None
        # While LOADING: how far its model load has come (0 to 1), as it last said.
        self.load_fraction: float | None = None

    @property
    def available(self) -> bool:
        """May take a new call: not removed, and SERVING or not checked yet."""
        return not self.removed and self.status in (WorkerStatus.UNKNOWN, WorkerStatus.SERVING)


@dataclass(frozen=True)
class ModelListing:
    """The models the reachable workers serve, and the ids of the workers that answered."""

    models: list[worker_pb2.ModelInfo]
    worker_ids: list[str]


@dataclass(frozen=True)
class WorkerHealth:
    """One worker's state in the pool (a :class:`WorkerStatus` name) and its calls in flight."""

    address: str
    status: str
    outstanding: int
    load_fraction: float | None = None  # while LOADING, when the worker said

    @property
    def serving(self) -> bool:
        return self.status == WorkerStatus.SERVING


class GenerateStream:
    """An open ``Generate`` call on one worker whose first event has arrived.

    Iterate it once: it yields every event, :attr:`first` included, ends when
    the call ends OK and raises :class:`EdgeError` when the call fails. Call
    :meth:`cancel` when done with it (a ``finally``): it cancels the call if
    it is still running and releases the worker's outstanding slot; it is
    idempotent and never raises.
    """

    def __init__(
        self, call: GenerateCall, worker: _Worker, first: worker_pb2.GenerateResponse, pool: WorkerPool
    ) -> None:
        self._call = call
        self._worker = worker
        self._pool = pool
        self.first = first
        self._released = False

    @property
    def worker_address(self) -> str:
        return self._worker.address

    @property
    def worker_id(self) -> str:
        """The serving worker's id: from its ``started`` event, else as the pool knows it ("")."""
        return self.first.started.worker_id or self._worker.worker_id or ""

    def __aiter__(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        return self._events()

    async def _events(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        try:
            yield self.first
            while (event := await self._call.read()) is not None:
                yield event
            self._pool.note_call_success(self._worker)
        except WorkerCallError as error:
            # A worker that dies mid-stream is ejected now, not at its next health check.
            self._pool.note_call_failure(self._worker, error)
            raise from_grpc(error) from None
        finally:
            # Covers the caller being cancelled inside read(): the call must not outlive it.
            self.cancel()

    def cancel(self) -> None:
        self._call.cancel()  # no-op once the call has ended
        if not self._released:
            self._released = True
            self._pool.release(self._worker)

    def __del__(self) -> None:
        # Safety net: a response body that never started (client gone before the
        # first byte) is dropped without running its generator's finally.
        if not self._released:
            with contextlib.suppress(Exception):  # e.g. the loop is already closed at exit
                self.cancel()


class WorkerPool:
    """The workers of one edge process. Use inside one event loop; ``close()`` at shutdown.

    ``addresses``: static ``host:port`` workers. ``dns_name``: a ``host:port``
    re-resolved every ``dns_refresh_interval_s``. At least one of the two is
    required. ``routing``: how a worker is chosen (:mod:`edge.workers.routing`).
    ``client_factory`` and ``resolver`` exist for tests.
    """

    def __init__(
        self,
        addresses: Sequence[str] = (),
        *,
        connect_timeout_s: float,
        health_timeout_s: float,
        health_interval_s: float = 5.0,
        dns_name: str | None = None,
        dns_refresh_interval_s: float = 10.0,
        client_factory: ClientFactory = WorkerClient,
        resolver: Resolver = resolve,
        routing: RoutingPolicy = RoutingPolicy.LEAST_OUTSTANDING,
    ) -> None:
        if not addresses and not dns_name:
            raise ValueError("a worker pool needs at least one address or a DNS name")
        self._dns = split_host_port(dns_name) if dns_name else None
        self._dns_name = dns_name
        self._client_factory = client_factory
        self._resolver = resolver
        self._workers: dict[str, _Worker] = {}
        for address in dict.fromkeys(addresses):
            self._workers[address] = _Worker(address, client_factory(address), static=True)
        self._rotation = itertools.count()
        self._affinity = PrefixAffinity() if routing == RoutingPolicy.PREFIX_AFFINITY else None
        self._connect_timeout_s = connect_timeout_s
        self._health_timeout_s = health_timeout_s
        self._health_interval_s = health_interval_s
        self._dns_refresh_interval_s = dns_refresh_interval_s
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._first_round: asyncio.Event | None = None
        self._closed = False

    # -- state -------------------------------------------------------------------------------

    @property
    def addresses(self) -> list[str]:
        """Every known worker address (static and resolved), removed ones included."""
        return list(self._workers)

    def outstanding(self) -> dict[str, int]:
        """Calls in flight per worker address."""
        return {w.address: w.outstanding for w in self._workers.values()}

    def snapshot(self) -> list[WorkerHealth]:
        """Every worker's state as of the last check or call, without asking anyone."""
        return [
            WorkerHealth(
                w.address,
                WorkerStatus.REMOVED if w.removed else w.status,
                w.outstanding,
                w.load_fraction if w.status == WorkerStatus.LOADING else None,
            )
            for w in self._workers.values()
        ]

    def release(self, worker: _Worker) -> None:
        """A call on ``worker`` ended (called once per call by :class:`GenerateStream`)."""
        worker.outstanding -= 1
        if worker.removed and worker.outstanding == 0:
            self._poke()  # the loop closes its channel

    def note_call_failure(self, worker: _Worker, error: WorkerCallError) -> None:
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

    def note_call_success(self, worker: _Worker) -> None:
        """A call on ``worker`` completed: its run of worker faults is over."""
        worker.worker_faults = 0

    def _eject(self, worker: _Worker, status: WorkerStatus, why: str) -> None:
        now = time.monotonic()
        was_available = worker.available
        worker.status = status
        worker.failures += 1
        backoff = eject_backoff_s(worker.failures, self._health_interval_s, random.uniform(-_JITTER, _JITTER))
        worker.next_check_at = now + backoff
        if was_available and not worker.removed:
            log.warning(
                "worker %s ejected (%s: %s); re-checking in %.1f s", worker.address, status, why, backoff
            )
        self._poke()

    def _restore(self, worker: _Worker) -> None:
        if worker.status != WorkerStatus.SERVING and not worker.removed:
            again = "" if worker.status == WorkerStatus.UNKNOWN else " again (taken back)"
            log.info("worker %s is serving%s", worker.address, again)
        worker.status = WorkerStatus.SERVING
        worker.load_fraction = None
        worker.failures = 0
        worker.next_check_at = time.monotonic() + self._health_interval_s

    def _candidates(self, preferred: str | None = None) -> list[_Worker]:
        """The available workers, best first: ``preferred`` (the routing policy's pick), then
        fewest outstanding calls, then round-robin."""
        workers = [w for w in self._workers.values() if w.available]
        if not workers:
            return []
        # The round-robin turns only for requests that the load decides: were it to turn for
        # every request, requests placed by affinity would skew which worker the next new
        # conversation gets (four turns per conversation on two workers: always the same one).
        start = next(self._rotation) if preferred is None else 0
        order = {id(w): (i - start) % len(workers) for i, w in enumerate(workers)}
        return sorted(workers, key=lambda w: (w.address != preferred, w.outstanding, order[id(w)]))

    def _loading_candidates(self) -> list[_Worker]:
        """The workers still loading their model: furthest along first, then fewest calls."""
        loading = [w for w in self._workers.values() if not w.removed and w.status == WorkerStatus.LOADING]
        return sorted(loading, key=lambda w: (-(w.load_fraction or 0.0), w.outstanding))

    def _none_available(self) -> ServiceUnavailableError:
        """503 for 'every worker is known down'; Retry-After is the next re-check (1 s at least)."""
        now = time.monotonic()
        soonest = min((w.next_check_at for w in self._workers.values() if not w.removed), default=now)
        retry = min(max(1.0, soonest - now), max(1.0, self._health_interval_s))
        return ServiceUnavailableError(NO_WORKER_MESSAGE, retry_after=retry)

    # -- lifecycle ---------------------------------------------------------------------------

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

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

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

    async def _check(self, worker: _Worker) -> None:
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

    async def _learn_loading(self, worker: _Worker) -> bool:
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

    async def _fresh_channel_if_backing_off(self, worker: _Worker) -> None:
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

    async def _refresh_dns(self) -> None:
        assert self._dns is not None  # only called with a DNS name
        host, port = self._dns
        try:
            async with asyncio.timeout(self._health_timeout_s * 2):
                resolved = await self._resolver(host, port)
        except (OSError, TimeoutError) as error:
            # Keep the workers we have: they are health-checked anyway.
            log.warning(
                "cannot resolve %s (%s); keeping %d workers", self._dns_name, error, len(self._workers)
            )
            return
        self.apply_resolved(resolved)

    def apply_resolved(self, resolved: Iterable[str]) -> None:
        """Makes the DNS workers exactly ``resolved``: new addresses are added (checked
        next), addresses gone are marked removed (no new calls; closed when idle)."""
        current = set(resolved)
        for address in sorted(current):
            worker = self._workers.get(address)
            if worker is None:
                self._workers[address] = _Worker(address, self._client_factory(address), static=False)
                log.info("worker %s added (resolved from %s)", address, self._dns_name)
                self._poke()
            elif worker.removed:
                worker.removed = False
                worker.next_check_at = 0.0
                log.info("worker %s is back in %s", address, self._dns_name)
        for worker in self._workers.values():
            if not worker.static and not worker.removed and worker.address not in current:
                worker.removed = True
                log.info("worker %s left %s; closing it once its calls end", worker.address, self._dns_name)

    async def _close_removed(self) -> None:
        gone = [w for w in self._workers.values() if w.removed and w.outstanding <= 0]
        for worker in gone:
            del self._workers[worker.address]
        await asyncio.gather(*(w.client.close() for w in gone), return_exceptions=True)

    # -- calls -------------------------------------------------------------------------------

    async def generate(
        self,
        request: worker_pb2.GenerateRequest,
        request_id: str,
        timeout_s: float,
        metadata: Sequence[tuple[str, str | bytes]] = (),
        *,
        load_events: bool = False,
    ) -> GenerateStream:
        """Opens ``Generate`` on the best worker and waits for its first event.

        When no worker serves and ``request.model_load_wait_seconds`` is positive, the
        workers still loading their model (LOADING) are tried instead: such a worker holds
        the call until its model is loaded (at most that long), sending MODEL_LOAD progress
        events. With ``load_events`` the first of those is the stream's first event (the
        caller shows the load); without, they are read here and the stream starts at
        ``started``, so a load that does not end in time is still an error before the stream.

        ``timeout_s`` is the call's total deadline in seconds, shared by all
        attempts. Raises :class:`EdgeError` when the call fails before its
        first event (after trying the other workers for UNAVAILABLE and
        RESOURCE_EXHAUSTED), and :class:`ServiceUnavailableError` (503,
        ``Retry-After``) at once when no worker is available. An error a
        worker answered carries that worker's id (``EdgeError.worker_id``), so
        the response can name it. If the caller is cancelled meanwhile, the
        call is cancelled too.
        """
        self._ensure_started()
        if self._dns is not None and not self._workers:
            await self.wait_first_round()  # first requests after start-up, before DNS answered
        deadline = time.monotonic() + timeout_s
        # The request id travels in the request's own field (GenerateRequest.request_id), once.
        call_metadata = tuple(metadata)
        blocks = prefix_blocks(request) if self._affinity is not None else []
        preferred = None
        if self._affinity is not None:
            load = {w.address: w.outstanding for w in self._workers.values() if w.available}
            preferred = self._affinity.choose(blocks, load)
        candidates = self._candidates(preferred)
        if not candidates and request.model_load_wait_seconds > 0:
            candidates = self._loading_candidates()
        if not candidates:
            raise self._none_available()
        last_error: EdgeError | None = None
        busy_error: EdgeError | None = None
        busy_worker: _Worker | None = None
        loop = asyncio.get_running_loop()
        for worker in candidates:
            if not (worker.available or worker.status == WorkerStatus.LOADING) or worker.removed:
                continue  # ejected meanwhile (another request saw it fail)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            worker.outstanding += 1
            call = worker.client.generate(request, timeout=remaining, metadata=call_metadata)
            waited_for_load = False
            try:
                async with asyncio.timeout(min(self._connect_timeout_s, remaining)) as first_event:
                    first = await call.read()
                    while not load_events and _is_model_load(first):
                        # The worker took the call and holds it until its model is loaded;
                        # it bounds that wait itself, the request's deadline bounds ours.
                        waited_for_load = True
                        first_event.reschedule(loop.time() + max(0.0, deadline - time.monotonic()))
                        first = await call.read()
            except WorkerCallError as error:
                call.cancel()
                self.release(worker)
                mapped = from_grpc(error)
                if error.code() not in _RETRY_BEFORE_FIRST_EVENT or waited_for_load:
                    # After a wait for a model load, the wait is over: no second wait elsewhere.
                    # Only the worker's own faults count against it (edge.workers.failures).
                    self.note_call_failure(worker, error)
                    mapped.worker_id = await self._learn_worker_id(worker)
                    raise mapped from None
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    busy_error, busy_worker = mapped, worker
                self.note_call_failure(worker, error)
                last_error = mapped
                log.info(
                    "request %s: worker %s refused (%s), trying the next",
                    request_id,
                    worker.address,
                    error.code().name,
                )
                continue
            except TimeoutError:
                call.cancel()
                self.release(worker)
                if deadline - time.monotonic() <= 0:
                    break  # the request's own deadline, not the worker's fault
                self._eject(worker, WorkerStatus.UNREACHABLE, "did not accept a call in time")
                log.warning(
                    "request %s: worker %s did not accept the call in %.1f s",
                    request_id,
                    worker.address,
                    self._connect_timeout_s,
                )
                last_error = ServiceUnavailableError(NO_WORKER_MESSAGE, retry_after=1.0)
                continue
            except BaseException:
                # Cancelled by our caller (client gone) or a bug: never leak the call.
                call.cancel()
                self.release(worker)
                raise
            if first is None:
                # The worker closed the call OK without a single event: a contract breach.
                self.release(worker)
                raise ServiceUnavailableError("The model worker ended the request without an answer.")
            if first.WhichOneof("event") == "started":
                if first.started.worker_id:
                    worker.worker_id = first.started.worker_id
                if worker.status == WorkerStatus.LOADING:
                    self._restore(worker)  # it answered a call: its model is loaded
            if self._affinity is not None:
                self._affinity.record(blocks, worker.address)
            return GenerateStream(call, worker, first, self)
        if busy_error is not None and busy_worker is not None:
            busy_error.worker_id = await self._learn_worker_id(busy_worker)
            raise busy_error
        if last_error is not None:
            raise last_error
        raise ServiceUnavailableError("The request timed out before a worker could take it.", retry_after=1.0)

    async def _learn_worker_id(self, worker: _Worker) -> str | None:
        """The worker's id: known from an earlier answer, else asked with ListModels
        (only on error paths; ``None`` when it does not answer in time)."""
        if worker.worker_id is None:
            try:
                reply = await worker.client.list_models(timeout=self._health_timeout_s)
            except WorkerCallError:
                return None
            worker.worker_id = reply.worker_id or None
        return worker.worker_id

    async def list_models(self) -> ModelListing:
        """Every model any available worker serves, deduplicated by id, in worker order,
        with the ids of the workers that answered.

        Raises :class:`ServiceUnavailableError` when no worker answered.
        """
        self._ensure_started()
        if self._dns is not None and not self._workers:
            await self.wait_first_round()
        workers = [w for w in self._workers.values() if w.available]
        results = await asyncio.gather(
            *(w.client.list_models(timeout=self._health_timeout_s) for w in workers),
            return_exceptions=True,
        )
        models: dict[str, worker_pb2.ModelInfo] = {}
        answered: list[str] = []
        for worker, result in zip(workers, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, WorkerCallError):
                    raise result
                log.info("ListModels on %s failed: %s", worker.address, result.code().name)
                self.note_call_failure(worker, result)
                continue
            worker.worker_id = result.worker_id or worker.worker_id
            answered.append(worker.worker_id or "")
            for model in result.models:
                models.setdefault(model.id, model)
        if not answered:
            raise self._none_available()
        return ModelListing(list(models.values()), [i for i in dict.fromkeys(answered) if i])

    async def health(self) -> list[WorkerHealth]:
        """Every worker's state from the pool's own checks (after the first round of
        checks has run, bounded); never calls the workers itself."""
        await self.wait_first_round()
        return self.snapshot()
