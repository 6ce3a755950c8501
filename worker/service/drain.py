"""Worker drain: refuse new ``Generate`` calls, let in-flight ones finish, then end them clearly.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import cast

import grpc

from sluice.v1 import worker_pb2 as pb
from sluice.v1 import worker_pb2_grpc as pb_grpc
from worker.errors import NotReady
from worker.service.servicer import WorkerService
from worker.service.streams import Events, Sink, relayed, serve_streams

log = logging.getLogger(__name__)

SHUTTING_DOWN_MESSAGE = "worker is shutting down; retry on another worker"
CUT_MESSAGE = "worker is shutting down: the grace period ended before this call finished"
# A refused caller may retry at once elsewhere; here, only after a restart.
_RETRY_AFTER_S = 1.0


@dataclass(eq=False)
class _Call:
    task: asyncio.Task[object] | None
    # True while the handler awaits the engine (the only safe place to cancel it).
    reading: bool = False
    cut: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)


class DrainingWorker(pb_grpc.WorkerServicer):
    """The Worker service as served: ``service``'s calls, plus refusal and cut-off at shutdown."""

    def __init__(self, service: WorkerService) -> None:
        self._service = service
        self._calls: set[_Call] = set()
        self._draining = False

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def in_flight(self) -> int:
        """``Generate`` calls currently running."""
        return len(self._calls)

    def start_drain(self) -> None:
        """From now on, new ``Generate`` calls are refused with UNAVAILABLE."""
        self._draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for every in-flight call to end; True if they all did."""
        calls = [call.done.wait() for call in self._calls]
        if not calls:
            return True
        try:
            await asyncio.wait_for(asyncio.gather(*calls), timeout_s)
        except TimeoutError:
            return False
        return True

    def cut(self) -> int:
        """Ends every in-flight call with UNAVAILABLE "worker is shutting down"; returns how many."""
        for call in self._calls:
            call.cut = True
            if call.reading and call.task is not None:
                call.task.cancel()
        return len(self._calls)

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        return await self._service.ListModels(request, context)

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        async with self._unary(context):
            return await self._service.Embed(request, context)

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        async with self._unary(context):
            return await self._service.Score(request, context)

    @contextlib.asynccontextmanager
    async def _unary(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """A one-message call (Embed, Score): refused while draining, counted in flight; a cut cancels
        it (its answer is one step of the pooling engine away)."""
        if self._draining:
            refusal = NotReady(SHUTTING_DOWN_MESSAGE, retry_after_seconds=_RETRY_AFTER_S)
            await context.abort_with_status(refusal.to_status())
        call = _Call(asyncio.current_task(), reading=True)
        self._calls.add(call)
        try:
            yield
        except asyncio.CancelledError:
            if not call.cut:
                raise
            if call.task is not None:
                call.task.uncancel()
            await context.abort_with_status(NotReady(CUT_MESSAGE).to_status())
        finally:
            self._calls.discard(call)
            call.done.set()

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        return await self._service.Tokenize(request, context)  # quick and engine-free: never refused

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        return await self._service.Detokenize(request, context)

    async def LoadLoraAdapter(
        self, request: pb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdapterResponse:
        return await self._service.LoadLoraAdapter(request, context)

    async def UnloadLoraAdapter(
        self, request: pb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdapterResponse:
        return await self._service.UnloadLoraAdapter(request, context)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        # WorkerService.Generate's events, tracked; its failures are statuses raised as errors.
        metadata = tuple(context.invocation_metadata() or ())
        events = self._tracked(
            lambda: self._service.generate_events(request, metadata, context.time_remaining)
        )
        async for event in relayed(events, context):
            yield event

    async def GenerateStreams(
        self, request_iterator: AsyncIterator[pb.StreamsRequest], context: grpc.aio.ServicerContext
    ) -> None:
        await serve_streams(context, self.stream_events)

    def stream_events(
        self, opened: pb.OpenStream, remaining: Callable[[], float | None], sink: Sink
    ) -> Events:
        """One stream of ``GenerateStreams``, drained as a ``Generate`` call is: refused while
        draining, cut when the grace ends."""
        return self._tracked(lambda: self._service.stream_events(opened, remaining, sink))

    async def _tracked(self, start: Callable[[], Events]) -> Events:
        """The events of ``start()``, refused with UNAVAILABLE while draining and cut with
        UNAVAILABLE by :meth:`cut` (both raised as :class:`NotReady`)."""
        if self._draining:
            raise NotReady(SHUTTING_DOWN_MESSAGE, retry_after_seconds=_RETRY_AFTER_S)
        call = _Call(asyncio.current_task())
        self._calls.add(call)
        # generate_events is an async generator function (typed as its iterator).
        events = cast(AsyncGenerator[pb.GenerateResponse, None], start())
        try:
            while not call.cut:
                call.reading = True
                try:
                    event = await anext(events)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if not call.cut:
                        raise  # the caller cancelled (or its deadline passed)
                    if call.task is not None:
                        call.task.uncancel()  # our own cut, not a cancellation of the call
                    break
                finally:
                    call.reading = False
                yield event
            await events.aclose()  # ends the sequence in the engine (the servicer's finally)
            log.info("in-flight call ended: %s", CUT_MESSAGE)
            raise NotReady(CUT_MESSAGE)
        finally:
            self._calls.discard(call)
            call.done.set()
            await events.aclose()
