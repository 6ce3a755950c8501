"""The worker calls behind one HTTP response, opened together and read as one stream.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from edge.deadlines import TimeLimits
from edge.errors import EdgeError
from edge.workers.call import WorkerCall
from edge.workers.migration import MigrationPolicy
from edge.workers.pool import WorkerPool
from sluice.v1 import worker_pb2

Event = tuple[int, worker_pb2.GenerateResponse]
# One open call (it moves to another worker if its worker dies, when its policy allows).
Call = WorkerCall


def _abandon(tasks: Sequence[asyncio.Future[Call]]) -> None:
    """Stops the attempts still running and closes every call already opened (a task that
    is still settling closes its call as soon as it does)."""
    for task in tasks:
        task.cancel()
        task.add_done_callback(_cancel_opened)


def _cancel_opened(task: asyncio.Future[Call]) -> None:
    """Cancels the call a settled ``WorkerCall.open`` task opened, if it opened one."""
    if not task.cancelled() and task.exception() is None:
        task.result().cancel()


class CallGroup:
    """Open calls whose first events have arrived; build one with :meth:`open`."""

    def __init__(self, streams: Sequence[Call]) -> None:
        self._streams = list(streams)
        # The request's time limits and total deadline (event loop clock), set by whoever
        # opened the group for a request (edge.surfaces.generation.open_calls).
        self.limits: TimeLimits | None = None
        self.deadline: float | None = None

    @property
    def streams(self) -> list[Call]:
        """The calls, in request order (each yields its first event again when iterated)."""
        return self._streams

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
        return self._streams[call].first.started

    @property
    def worker_ids(self) -> list[str]:
        """The distinct ids of the workers serving the calls, in call order."""
        ids = (stream.worker_id for stream in self._streams)
        return list(dict.fromkeys(i for i in ids if i))

    def cancel(self) -> None:
        """Cancels every call still running; idempotent, never raises."""
        for stream in self._streams:
            stream.cancel()

    def events(self) -> AsyncIterator[Event]:
        """Every event of every call (first events included) as ``(call index, event)``.

        Ends when every call ended OK; raises the first call failure as an
        :class:`EdgeError` (the other calls are then cancelled).
        """
        if len(self._streams) == 1:
            return self._single()
        return self._merged()

    async def _single(self) -> AsyncIterator[Event]:
        try:
            async for event in self._streams[0]:
                yield 0, event
        finally:
            self.cancel()

    async def _merged(self) -> AsyncIterator[Event]:
        queue: asyncio.Queue[Event | tuple[int, None] | BaseException] = asyncio.Queue()

        async def pump(index: int, stream: Call) -> None:
            try:
                async for event in stream:
                    queue.put_nowait((index, event))
                queue.put_nowait((index, None))
            except Exception as error:  # handed to the reader, which raises it
                queue.put_nowait(error)

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self._streams)]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                index, event = item
                if event is None:
                    running -= 1
                    continue
                yield index, event
        finally:
            self.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
