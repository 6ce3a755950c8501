"""One ``Generate`` call on the fleet: opened on the best worker that takes it (the next one is tried
while no event arrived), read to its end, and moved to another worker if its worker dies mid-stream.

Design notes: docs/edge-internals.md, "Worker calls".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc

from edge.errors import EdgeError, ServiceUnavailableError, from_grpc
from edge.tracing import current_trace
from edge.workers.failures import RETRY_ELSEWHERE
from edge.workers.health import NO_WORKER_MESSAGE
from edge.workers.migration import Delivered, MigrationPolicy
from edge.workers.pool import WorkerPool
from edge.workers.worker import Worker, WorkerStatus, is_model_load
from sluice.client import WorkerCallError
from sluice.streams import EventCall, StreamCall
from sluice.v1 import worker_pb2

log = logging.getLogger("sluice.edge")

Metadata = Sequence[tuple[str, str | bytes]]
_NO_MIGRATION = MigrationPolicy(0)


@dataclass(frozen=True)
class Inline:
    """Where a call's events go when taken as they arrive (:meth:`WorkerCall.take_inline`):
    ``ready()`` False leaves an event to the reader; ``take`` gets each event the reader would
    have got; ``failed`` gets what raised on the way."""

    ready: Callable[[], bool]
    take: Callable[[worker_pb2.GenerateResponse], None]
    failed: Callable[[Exception], None]


@dataclass
class _Leg:
    """The call on one worker: the gRPC call, the worker whose outstanding slot it holds, and the
    call's first event."""

    call: EventCall
    worker: Worker
    first: worker_pb2.GenerateResponse
    pool: WorkerPool
    released: bool = False

    def close(self) -> None:
        """Cancels the call (a no-op once it ended) and releases the worker's slot; idempotent."""
        self.call.cancel()
        if not self.released:
            self.released = True
            self.pool.release(self.worker)


class WorkerCall:
    """A ``Generate`` call whose first event has arrived; build one with :meth:`open`.

    Iterate it once: it yields every event, :attr:`first` included, ends when the call ends OK and
    raises :class:`EdgeError` when it fails for good. A call whose worker dies mid-stream goes on,
    on another worker, when its ``migration`` policy allows (:mod:`edge.workers.migration`): the
    caller reads one continuous stream. Call :meth:`cancel` when done with it (a ``finally``): it
    cancels the call if it is still running and releases the worker's outstanding slot; it is
    idempotent and never raises.
    """

    def __init__(
        self,
        pool: WorkerPool,
        leg: _Leg,
        request: worker_pb2.GenerateRequest,
        *,
        request_id: str,
        deadline: float,
        metadata: Metadata,
        migration: MigrationPolicy,
    ) -> None:
        self._pool = pool
        self._leg = self._origin = leg
        self._request_id = request_id
        self._deadline = deadline  # the request's, time.monotonic(): no new leg opens after it
        self._metadata = tuple(metadata)
        self._policy = migration
        self._delivered = Delivered(request)
        self._cancelled = False
        self.first = leg.first
        self.migrations = 0
        self._inline: Inline | None = None
        self._trace = current_trace()  # the request's span (--otlp-traces-endpoint), for migrations

    @classmethod
    async def open(
        cls,
        pool: WorkerPool,
        request: worker_pb2.GenerateRequest,
        request_id: str,
        timeout_s: float,
        metadata: Metadata = (),
        *,
        migration: MigrationPolicy | None = None,
        load_events: bool = False,
    ) -> WorkerCall:
        """Opens ``Generate`` on the best worker (:meth:`WorkerPool.place`) and waits for its first
        event; ``timeout_s`` is the call's total deadline in seconds, shared by every attempt and
        every move.

        A call that fails with UNAVAILABLE or RESOURCE_EXHAUSTED, or sends no first event within
        the pool's connect timeout, is tried on the next worker; any other failure is raised at once
        as an :class:`EdgeError` naming the worker that answered (``EdgeError.worker_id``), and
        :class:`ServiceUnavailableError` (503, ``Retry-After``) when no worker is available. A worker
        loading its model holds the call until the load ends, sending MODEL_LOAD progress events:
        with ``load_events`` the first of those is :attr:`first` (the caller shows the load);
        without, they are read here and the stream starts at ``started``, so a load that does not
        end in time is still an error before the stream. If the caller is cancelled meanwhile, the
        call is cancelled too.
        """
        deadline = time.monotonic() + timeout_s
        trace, started_ns = current_trace(), time.time_ns()
        metadata = (*metadata, *trace.metadata) if trace is not None else metadata
        leg = await _open_leg(pool, request, request_id, deadline, metadata, load_events=load_events)
        if trace is not None:
            trace.placed(leg.worker.address, request.model, started_ns)
        return cls(
            pool,
            leg,
            request,
            request_id=request_id,
            deadline=deadline,
            metadata=metadata,
            migration=migration or _NO_MIGRATION,
        )

    @property
    def worker_address(self) -> str:
        """The address of the worker serving the call now."""
        return self._leg.worker.address

    @property
    def worker_id(self) -> str:
        """The id of the worker that accepted the call (what the response headers name), even after
        the call moved: from its ``started`` event, else as the pool knows it ("")."""
        return self._origin.first.started.worker_id or self._origin.worker.worker_id or ""

    def cancel(self) -> None:
        """Cancels the call (idempotent); a move in progress stops too."""
        self._cancelled = True
        self._leg.close()

    def __aiter__(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        return self._events()

    def take_inline(self, inline: Inline) -> None:
        """While the iteration waits for a multiplexed call's next event, a lone event that
        arrives goes to ``inline`` then and there, tracked for migration as iterating tracks it,
        without waking the iterating task (one task wake and its generators less per token).
        Ends, failures and anything else still come through the iteration."""
        self._inline = inline

    def _take(self, event: worker_pb2.GenerateResponse) -> bool:
        """:attr:`StreamCall.inline` of this call's legs (see :meth:`take_inline`)."""
        inline = self._inline
        if inline is None or not inline.ready():
            return False
        try:
            if self._policy.enabled:
                for out in self._delivered.track(event, self.migrations > 0):
                    inline.take(out)
            else:
                inline.take(event)
        except Exception as error:  # as if raised to the iteration: this request fails, no other
            inline.failed(error)
        return True

    def __del__(self) -> None:
        # Safety net: a response body that never started (client gone before the first byte) is
        # dropped without running its generator's finally.
        leg = getattr(self, "_leg", None)
        if leg is not None and not leg.released:
            with contextlib.suppress(Exception):  # e.g. the loop is already closed at exit
                leg.close()

    async def _events(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        movable = self._policy.enabled
        event: worker_pb2.GenerateResponse | None = self.first
        try:
            while event is not None:
                if movable:
                    for out in self._delivered.track(event, self.migrations > 0):
                        yield out
                else:
                    yield event
                call = self._leg.call
                if self._inline is not None and isinstance(call, StreamCall):
                    call.inline = self._take
                try:
                    event = await call.read()
                except WorkerCallError as error:
                    # A worker that dies mid-stream is ejected now, not at its next health check.
                    self._pool.note_call_failure(self._leg.worker, error)
                    self._leg.close()
                    failure = from_grpc(error)
                    outcome = await self._move(failure)
                    if outcome == "resumed":
                        event = self._leg.first
                        continue
                    for out in self._delivered.release_held():  # what the caller would have had
                        yield out
                    if outcome == "ended":
                        return
                    raise failure from None
            self._pool.note_call_success(self._leg.worker)
            for out in self._delivered.release_held():  # a well-behaved worker leaves none held
                yield out
        finally:
            # Covers the caller being cancelled inside read(): the call must not outlive it.
            self.cancel()

    async def _move(self, failure: EdgeError) -> str | None:
        """Tries to go on after ``failure``: "resumed" when a call on another worker now serves the
        request (``self._leg``), "ended" when the failed call had nothing left but its usage, None
        when ``failure`` stands."""
        if not self._policy.enabled or not isinstance(failure, ServiceUnavailableError) or self._cancelled:
            return None  # not a worker failure (or the caller is gone)
        failed_at, delivered = self._leg.worker.address, self._delivered
        if delivered.resumable and delivered.all_finished():
            log.info(
                "request %s: worker %s failed after the last choice finished", self._request_id, failed_at
            )
            return "ended"
        if not delivered.resumable:
            self._policy.count("not_resumable")
            return None
        if self.migrations >= self._policy.max_migrations:
            self._policy.count("limit_reached")
            log.warning(
                "request %s: worker %s failed mid-stream; not moved (already moved %d times)",
                self._request_id,
                failed_at,
                self.migrations,
            )
            return None
        if self._deadline <= time.monotonic():
            return None
        trace, started_ns = self._trace, time.time_ns()
        try:
            leg = await _open_leg(
                self._pool, delivered.resume_request(), self._request_id, self._deadline, self._metadata
            )
        except EdgeError as refused:
            self._policy.count("failed")
            log.warning(
                "request %s: worker %s failed mid-stream and no worker took the rest (%s: %s)",
                self._request_id,
                failed_at,
                refused.type,
                refused.message,
            )
            return None
        if self._cancelled or leg.first.WhichOneof("event") != "started" or not leg.first.started.resumable:
            leg.close()  # the caller went away meanwhile, or the worker would restart from scratch
            self._policy.count("failed")
            return None
        delivered.drop_held()  # the new worker sends them again
        if trace is not None:
            trace.placed(leg.worker.address, leg.first.started.model, started_ns, migration=True)
        self.migrations += 1
        self._leg = leg
        self._policy.count("resumed")
        log.warning(
            "request %s: worker %s failed mid-stream; moved to %s after %d tokens",
            self._request_id,
            failed_at,
            leg.worker.address,
            delivered.tokens,
        )
        return "resumed"


@dataclass
class _Refusals:
    """What the workers tried so far answered: the error raised when none took the call."""

    last: EdgeError | None = None
    busy: tuple[EdgeError, Worker] | None = None  # a full queue: preferred, it says to retry

    async def error(self, pool: WorkerPool) -> EdgeError:
        if self.busy is not None:
            error, worker = self.busy
            error.worker_id = await pool.learn_worker_id(worker)
            return error
        if self.last is not None:
            return self.last
        return ServiceUnavailableError(
            "The request timed out before a worker could take it.", retry_after=1.0
        )


async def _open_leg(
    pool: WorkerPool,
    request: worker_pb2.GenerateRequest,
    request_id: str,
    deadline: float,
    metadata: Metadata,
    *,
    load_events: bool = False,
) -> _Leg:
    """The call on the first worker, best first, that sends a first event before ``deadline``; see
    :meth:`WorkerCall.open`."""
    placement = await pool.place(request)
    refusals = _Refusals()
    for worker in placement.workers:
        if worker.removed or not (worker.available or worker.status == WorkerStatus.LOADING):
            continue  # ejected meanwhile (another request saw it fail)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        # The request id travels in the request's own field (GenerateRequest.request_id), once.
        call = pool.dial(worker, request, remaining, tuple(metadata))
        leg = await _first_event(pool, worker, call, request_id, deadline, refusals, load_events=load_events)
        if leg is not None:
            pool.accepted(worker, leg.first, placement)
            return leg
    raise await refusals.error(pool)


async def _first_event(
    pool: WorkerPool,
    worker: Worker,
    call: EventCall,
    request_id: str,
    deadline: float,
    refusals: _Refusals,
    *,
    load_events: bool,
) -> _Leg | None:
    """Waits for ``call``'s first event on ``worker``: the leg, or None when the next worker is to
    be tried (the refusal noted in ``refusals``); raises the failures that are final."""
    waited_for_load = False
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(min(pool.connect_timeout_s, deadline - time.monotonic())) as timer:
            first = await call.read()
            while not load_events and is_model_load(first):
                # The worker took the call and holds it until its model is loaded; it bounds
                # that wait itself, the request's deadline bounds ours.
                waited_for_load = True
                timer.reschedule(loop.time() + max(0.0, deadline - time.monotonic()))
                first = await call.read()
    except WorkerCallError as error:
        call.cancel()
        pool.release(worker)
        await _refused(pool, worker, error, request_id, refusals, final=waited_for_load)
        return None
    except TimeoutError:
        call.cancel()
        pool.release(worker)
        if deadline - time.monotonic() > 0:  # else the request's own deadline, not the worker's fault
            pool.too_slow(worker)
            log.warning(
                "request %s: worker %s did not accept the call in %.1f s",
                request_id,
                worker.address,
                pool.connect_timeout_s,
            )
            refusals.last = ServiceUnavailableError(NO_WORKER_MESSAGE, retry_after=1.0)
        return None
    except BaseException:
        # Cancelled by our caller (client gone) or a bug: never leak the call.
        call.cancel()
        pool.release(worker)
        raise
    if first is None:
        # The worker closed the call OK without a single event: a contract breach.
        pool.release(worker)
        raise ServiceUnavailableError("The model worker ended the request without an answer.")
    return _Leg(call, worker, first, pool)


async def _refused(
    pool: WorkerPool,
    worker: Worker,
    error: WorkerCallError,
    request_id: str,
    refusals: _Refusals,
    *,
    final: bool,
) -> None:
    """``worker`` refused the call before its first event: raises the failure unless it is one that
    the next worker may not have (``final``: after a wait for a model load, the wait is over; there
    is no second wait elsewhere). Only the worker's own faults count against it
    (:mod:`edge.workers.failures`)."""
    pool.note_call_failure(worker, error)
    mapped = from_grpc(error)
    if error.code() not in RETRY_ELSEWHERE or final:
        mapped.worker_id = await pool.learn_worker_id(worker)
        raise mapped from None
    if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        refusals.busy = (mapped, worker)
    refusals.last = mapped
    log.info(
        "request %s: worker %s refused (%s), trying the next", request_id, worker.address, error.code().name
    )
