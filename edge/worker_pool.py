"""Channels to the workers, load-balanced Generate calls, health and model listing.

One ``grpc.aio`` channel per worker address, created lazily inside the
running event loop (grpc.aio binds to the loop it first runs in). Each
request goes to the worker with the fewest outstanding calls, ties broken
round-robin; workers that just failed to connect go last.

A request may move to another worker only before its first event: a call
that fails with UNAVAILABLE (worker down, starting or draining) or
RESOURCE_EXHAUSTED (its queue is full), or that does not send its first
event within ``connect_timeout_s``, is retried on the next worker. Once an
event arrived the request stays where it is.

Every gRPC failure leaves this module as an :class:`~edge.errors.EdgeError`
(via :func:`edge.errors.from_grpc`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edge.errors import EdgeError, ServiceUnavailableError, from_grpc
from sluice.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("sluice.edge")

WORKER_SERVICE = "sluice.v1.Worker"
# How long a worker that refused a connection is tried after the others.
_DOWN_PENALTY_S = 2.0
_RETRY_BEFORE_FIRST_EVENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class _Worker:
    """One worker address: its channel, stubs and live counters."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.outstanding = 0
        self.down_until = 0.0
        # The worker's own id (``started.worker_id``), learned from its answers.
        self.worker_id: str | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: worker_pb2_grpc.WorkerStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None

    def _connect(self) -> None:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.address)
            self._stub = worker_pb2_grpc.WorkerStub(self._channel)
            self._health = health_pb2_grpc.HealthStub(self._channel)

    def warm_up(self) -> None:
        self._connect()
        assert self._channel is not None  # for the type checker: _connect() set it
        self._channel.get_state(try_to_connect=True)

    @property
    def stub(self) -> worker_pb2_grpc.WorkerStub:
        self._connect()
        assert self._stub is not None  # for the type checker: _connect() set it
        return self._stub

    @property
    def health_stub(self) -> health_pb2_grpc.HealthStub:
        self._connect()
        assert self._health is not None  # for the type checker: _connect() set it
        return self._health

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel, self._stub, self._health = self._channel, None, None, None
            await channel.close(grace=None)


@dataclass(frozen=True)
class ModelListing:
    """The models the reachable workers serve, and the ids of the workers that answered."""

    models: list[worker_pb2.ModelInfo]
    worker_ids: list[str]


@dataclass(frozen=True)
class WorkerHealth:
    """One worker's answer to a health check: SERVING, NOT_SERVING, UNKNOWN or UNREACHABLE."""

    address: str
    status: str
    outstanding: int

    @property
    def serving(self) -> bool:
        return self.status == "SERVING"


class GenerateStream:
    """An open ``Generate`` call on one worker whose first event has arrived.

    Iterate it once: it yields every event, :attr:`first` included, ends when
    the call ends OK and raises :class:`EdgeError` when the call fails. Call
    :meth:`cancel` when done with it (a ``finally``): it cancels the call if
    it is still running and releases the worker's outstanding slot; it is
    idempotent and never raises.
    """

    def __init__(
        self, call: grpc.aio.UnaryStreamCall, worker: _Worker, first: worker_pb2.GenerateResponse
    ) -> None:
        self._call = call
        self._worker = worker
        self.first = first
        self._released = False

    @property
    def worker_address(self) -> str:
        return self._worker.address

    def __aiter__(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        return self._events()

    async def _events(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        try:
            yield self.first
            while True:
                event = await self._call.read()
                if event is grpc.aio.EOF:
                    return
                yield event
        except grpc.aio.AioRpcError as error:
            raise from_grpc(error) from None
        finally:
            # Covers the caller being cancelled inside read(): the call must not outlive it.
            self.cancel()

    def cancel(self) -> None:
        self._call.cancel()  # no-op once the call has ended
        if not self._released:
            self._released = True
            self._worker.outstanding -= 1

    def __del__(self) -> None:
        # Safety net: a response body that never started (client gone before the
        # first byte) is dropped without running its generator's finally.
        if not self._released:
            with contextlib.suppress(Exception):  # e.g. the loop is already closed at exit
                self.cancel()


class WorkerPool:
    """The workers of one edge process. Use inside one event loop; ``close()`` at shutdown."""

    def __init__(
        self, addresses: Sequence[str], *, connect_timeout_s: float, health_timeout_s: float
    ) -> None:
        if not addresses:
            raise ValueError("a worker pool needs at least one address")
        self._workers = [_Worker(a) for a in addresses]
        self._rotation = itertools.count()
        self._connect_timeout_s = connect_timeout_s
        self._health_timeout_s = health_timeout_s

    @property
    def addresses(self) -> list[str]:
        return [w.address for w in self._workers]

    def outstanding(self) -> dict[str, int]:
        """Calls in flight per worker address."""
        return {w.address: w.outstanding for w in self._workers}

    def open(self) -> None:
        """Creates every channel and starts connecting, so the first request finds it warm.

        Optional (channels are also created on first use); must run inside the serving loop.
        """
        for worker in self._workers:
            worker.warm_up()

    async def close(self) -> None:
        """Closes every channel, cancelling calls still open on them."""
        await asyncio.gather(*(w.close() for w in self._workers), return_exceptions=True)

    def _candidates(self) -> list[_Worker]:
        """All workers, best first: reachable, then fewest outstanding, then round-robin."""
        now = time.monotonic()
        start = next(self._rotation)
        count = len(self._workers)
        order = {id(w): (i - start) % count for i, w in enumerate(self._workers)}
        return sorted(self._workers, key=lambda w: (w.down_until > now, w.outstanding, order[id(w)]))

    async def generate(
        self,
        request: worker_pb2.GenerateRequest,
        request_id: str,
        timeout_s: float,
        metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> GenerateStream:
        """Opens ``Generate`` on the best worker and waits for its first event.

        ``timeout_s`` is the call's total deadline in seconds, shared by all
        attempts. Raises :class:`EdgeError` when the call fails before its
        first event (after trying the other workers for UNAVAILABLE and
        RESOURCE_EXHAUSTED). An error a worker answered carries that worker's
        id (``EdgeError.worker_id``), so the response can name it. If the
        caller is cancelled meanwhile, the call is cancelled too.
        """
        deadline = time.monotonic() + timeout_s
        call_metadata = tuple(metadata)
        if not any(key == "x-request-id" for key, _ in call_metadata):
            call_metadata = (("x-request-id", request_id), *call_metadata)
        last_error: EdgeError | None = None
        busy_error: EdgeError | None = None
        busy_worker: _Worker | None = None
        for worker in self._candidates():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            worker.outstanding += 1
            call = worker.stub.Generate(request, timeout=remaining, metadata=call_metadata)
            try:
                first = await asyncio.wait_for(call.read(), timeout=min(self._connect_timeout_s, remaining))
            except grpc.aio.AioRpcError as error:
                call.cancel()
                worker.outstanding -= 1
                mapped = from_grpc(error)
                if error.code() not in _RETRY_BEFORE_FIRST_EVENT:
                    mapped.worker_id = await self._learn_worker_id(worker)
                    raise mapped from None
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    worker.down_until = time.monotonic() + _DOWN_PENALTY_S
                else:
                    busy_error, busy_worker = mapped, worker
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
                worker.outstanding -= 1
                worker.down_until = time.monotonic() + _DOWN_PENALTY_S
                log.warning(
                    "request %s: worker %s did not accept the call in %.1f s",
                    request_id,
                    worker.address,
                    self._connect_timeout_s,
                )
                last_error = ServiceUnavailableError(
                    "No model worker is available; please retry later.", retry_after=1.0
                )
                continue
            except BaseException:
                # Cancelled by our caller (client gone) or a bug: never leak the call.
                call.cancel()
                worker.outstanding -= 1
                raise
            if first is grpc.aio.EOF:
                # The worker closed the call OK without a single event: a contract breach.
                worker.outstanding -= 1
                raise ServiceUnavailableError("The model worker ended the request without an answer.")
            if first.WhichOneof("event") == "started" and first.started.worker_id:
                worker.worker_id = first.started.worker_id
            return GenerateStream(call, worker, first)
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
                reply = await worker.stub.ListModels(
                    worker_pb2.ListModelsRequest(), timeout=self._health_timeout_s
                )
            except grpc.RpcError:
                return None
            worker.worker_id = reply.worker_id or None
        return worker.worker_id

    async def list_models(self) -> ModelListing:
        """Every model any reachable worker serves, deduplicated by id, in worker order,
        with the ids of the workers that answered.

        Raises :class:`ServiceUnavailableError` when no worker answered.
        """
        results = await asyncio.gather(
            *(
                w.stub.ListModels(worker_pb2.ListModelsRequest(), timeout=self._health_timeout_s)
                for w in self._workers
            ),
            return_exceptions=True,
        )
        models: dict[str, worker_pb2.ModelInfo] = {}
        answered: list[str] = []
        for worker, result in zip(self._workers, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, grpc.RpcError):
                    raise result
                log.info("ListModels on %s failed: %s", worker.address, result.code().name)
                continue
            worker.worker_id = result.worker_id or worker.worker_id
            answered.append(worker.worker_id or "")
            for model in result.models:
                models.setdefault(model.id, model)
        if not answered:
            raise ServiceUnavailableError(
                "No model worker is available; please retry later.", retry_after=1.0
            )
        return ModelListing(list(models.values()), [i for i in dict.fromkeys(answered) if i])

    async def health(self) -> list[WorkerHealth]:
        """Checks every worker with grpc.health.v1 (``sluice.v1.Worker``, else ``""``)."""
        statuses = await asyncio.gather(*(self._check(w) for w in self._workers))
        return [
            WorkerHealth(w.address, s, w.outstanding) for w, s in zip(self._workers, statuses, strict=True)
        ]

    async def _check(self, worker: _Worker) -> str:
        for service in (WORKER_SERVICE, ""):
            try:
                reply = await worker.health_stub.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=self._health_timeout_s
                )
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    continue  # this worker does not register the named service; ask about the server
                return "UNREACHABLE"
            return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
        return "UNKNOWN"
