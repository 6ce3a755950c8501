"""The worker calls behind one HTTP response, opened together and read as one stream.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Protocol

from edge.deadlines import TimeLimits
from edge.errors import EdgeError
from edge.workers.call import Inline, WorkerCall
from edge.workers.migration import MigrationPolicy
from edge.workers.pool import WorkerPool
from sluice.v1 import worker_pb2

Event = tuple[int, worker_pb2.GenerateResponse]


class Call(Protocol):
    """One open call of a group (a :class:`WorkerCall`; the tests bring fakes): its first event,
    the id of the worker that took it, its events (the first one included), and ``cancel``."""

    first: worker_pb2.GenerateResponse

    @property
    def worker_id(self) -> str: ...

    def __aiter__(self) -> AsyncIterator[worker_pb2.GenerateResponse]: ...

    def cancel(self) -> None: ...


def _abandon(tasks: Sequence[asyncio.Future[WorkerCall]]) -> None:
    """Stops the attempts still running and closes every call already opened (a task that
    is still settling closes its call as soon as it does)."""
    for task in tasks:
        task.cancel()
        task.add_done_callback(_cancel_opened)


def _cancel_opened(task: asyncio.Future[WorkerCall]) -> None:
    """Cancels the call a settled ``WorkerCall.open`` task opened, if it opened one."""
    if not task.cancelled() and task.exception() is None:
        task.result().cancel()


class CallGroup:
    """Open calls whose first events have arrived; build one with :meth:`open`, read it with
    :meth:`events`."""

    def __init__(self, calls: Sequence[Call]) -> None:
        self._calls = list(calls)
        # The request's time limits and total deadline (event loop clock), set by whoever
        # opened the group for a request (edge.surfaces.generation.open_calls).
        self.limits: TimeLimits | None = None
        self.deadline: float | None = None
        # Sees every event as it is read (a rate-limited key's token meter, edge.rate_limits).
        self.observer: Callable[[int, worker_pb2.GenerateResponse], None] | None = None

    def time_limits(self) -> TimeLimits:
        """The request's :attr:`limits`; raises ``RuntimeError`` when nobody set them."""
        if self.limits is None:
            raise RuntimeError("the call group has no time limits: open it with open_calls")
        return self.limits

    @classmethod
    async def open(
        cls,
        pool: WorkerPool,
        requests: Sequence[worker_pb2.GenerateRequest],
        request_id: str,
        timeout_s: float,
        metadata: Sequence[tuple[str, str | bytes]] = (),
        *,
        migration: MigrationPolicy | None = None,
        load_events: bool = False,
    ) -> CallGroup:
        """Opens one call per request (:meth:`WorkerCall.open`, with ``migration`` and
        ``load_events``), concurrently, and waits for every first event.

        The first call to fail before its first event fails the whole group at
        once: the other calls are cancelled (opened or still opening) and that
        failure is raised (an :class:`EdgeError`; among failures seen together,
        the lowest-numbered call's). With an enabled ``migration`` policy, each
        call that can be resumed (:mod:`edge.workers.migration`) moves to another worker
        if its worker dies mid-stream, within ``timeout_s``; such requests
        should ask for ``return_token_ids``.
        """

        async def open_one(request: worker_pb2.GenerateRequest) -> WorkerCall:
            return await WorkerCall.open(
                pool, request, request_id, timeout_s, metadata, migration=migration, load_events=load_events
            )

        if len(requests) == 1:
            return cls([await open_one(requests[0])])
        tasks = [asyncio.ensure_future(open_one(r)) for r in requests]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except BaseException:
            _abandon(tasks)  # cancelled: the client went away
            raise
        failures = [error for task in tasks if task.done() and (error := task.exception()) is not None]
        if failures:
            _abandon(tasks)
            edge_errors = [f for f in failures if isinstance(f, EdgeError)]
            raise edge_errors[0] if len(edge_errors) == len(failures) else failures[0]
        return cls([task.result() for task in tasks])

    def started(self, call: int) -> worker_pb2.Started:
        """The ``started`` event of call ``call`` (its first event; empty when the first event
        was a model-load progress event, see :meth:`open`)."""
        return self._calls[call].first.started

    @property
    def worker_ids(self) -> list[str]:
        """The distinct ids of the workers serving the calls, in call order."""
        ids = (call.worker_id for call in self._calls)
        return list(dict.fromkeys(i for i in ids if i))

    def cancel(self) -> None:
        """Cancels every call still running; idempotent, never raises."""
        for call in self._calls:
            call.cancel()

    def take_inline(
        self,
        ready: Callable[[], bool],
        take: Callable[[int, worker_pb2.GenerateResponse], None],
        failed: Callable[[Exception], None],
    ) -> None:
        """Lets a one-call group's events reach ``take(0, event)`` as they arrive while
        :meth:`events` waits for them (:meth:`WorkerCall.take_inline`), observed as :meth:`events`
        observes them; the events of several calls come only through :meth:`events`."""
        call = self._calls[0] if len(self._calls) == 1 else None
        if not isinstance(call, WorkerCall):
            return

        def take_one(event: worker_pb2.GenerateResponse) -> None:
            if self.observer is not None:
                self.observer(0, event)
            take(0, event)

        call.take_inline(Inline(ready, take_one, failed))

    def events(self) -> AsyncGenerator[Event, None]:
        """Every event of every call (first events included) as ``(call index, event)``: the one
        read of a response's calls (the stream pump's, or a non-streamed answer's).

        The order within one call is kept; calls interleave as their events arrive, and the calls
        are read at most two events per call ahead of the caller (flow control holds the rest in
        the workers).
        Ends when every call ended OK; raises the first call failure as an :class:`EdgeError`, after
        the events read before it (every call is cancelled at the failure). Closing the iterator
        (or cancelling its reader) cancels every call.
        """
        if len(self._calls) == 1:
            return self._single()
        return self._merged()

    async def _single(self) -> AsyncGenerator[Event, None]:
        try:
            async for event in self._calls[0]:
                if self.observer is not None:
                    self.observer(0, event)
                yield 0, event
        finally:
            self.cancel()

    async def _merged(self) -> AsyncGenerator[Event, None]:
        # One slot per call: a reader that finds the queue full waits with the event it read, so a
        # slow caller stops the reads (at most two events per call read and not yet taken).
        queue: asyncio.Queue[tuple[int, worker_pb2.GenerateResponse | None]] = asyncio.Queue(len(self._calls))
        failures: list[Exception] = []  # the first one is raised; the others follow from it

        async def read(index: int, call: Call) -> None:
            try:
                async for event in call:
                    await queue.put((index, event))
            except Exception as error:  # handed to the caller, which raises it
                failures.append(error)
                self.cancel()  # the other calls end now, as the request does
            await queue.put((index, None))

        tasks = [asyncio.create_task(read(i, call)) for i, call in enumerate(self._calls)]
        try:
            running = len(tasks)
            while running:
                index, event = await queue.get()
                if event is not None:
                    if self.observer is not None:
                        self.observer(index, event)
                    yield index, event
                    continue
                if failures:
                    raise failures[0]
                running -= 1
        finally:
            self.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
