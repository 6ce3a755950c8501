"""The async facade of one submitted request: its events, processed from the core's outputs on the
request's own event loop; stopping early aborts the request in the engine."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Protocol

from worker.output.detokenizer import TokenTexts, fast_decoder
from worker.output.processor import RequestOutputProcessor, TextRules, coalesce
from worker.types import CoreOutput, Event, Failed, GenerationRequest

log = logging.getLogger(__name__)


class StreamOwner(Protocol):
    """What a stream tells its engine (:class:`worker.engine.core.Engine`)."""

    def abort(self, key: str, *, failed: bool = False) -> None: ...

    def stop_choices(self, key: str, choices: Iterable[int]) -> None: ...


class RequestStream:
    """The events of one submitted request, as an async iterator.

    Iterate it once. Stopping early (``cancel()``, a cancelled task, or closing
    the iterator) aborts the request in the engine.
    """

    def __init__(
        self,
        engine: StreamOwner,
        key: str,
        loop: asyncio.AbstractEventLoop,
        processor: RequestOutputProcessor,
    ):
        self._engine = engine
        self.key = key
        self._loop = loop
        self._processor = processor
        self._queue: asyncio.Queue[list[CoreOutput]] = asyncio.Queue()
        self._finished = False
        self._handler: Callable[[list[Event]], None] | None = None  # set by :meth:`pushed`
        self._ended: asyncio.Future[None] | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def ended_while_priming(self) -> bool:
        """A resumed request whose resumed text already ended it (nothing is generated)."""
        return self._processor.ended_while_priming

    def put(self, outputs: list[CoreOutput]) -> None:
        """Runs on the stream's event loop (the engine thread calls it with ``call_soon_threadsafe``)."""
        if self._handler is None:
            self._queue.put_nowait(outputs)
        else:
            self._push(outputs)

    def cancel(self) -> None:
        if not self._finished:
            self._finished = True
            self._engine.abort(self.key)

    async def __aiter__(self) -> AsyncIterator[Event]:
        try:
            while not self._finished:
                outputs = await self._queue.get()
                while not self._queue.empty():  # the consumer fell behind: take every waiting step
                    outputs += self._queue.get_nowait()
                for event in self._process(outputs):
                    yield event
        finally:
            self.cancel()

    async def pushed(self, handler: Callable[[list[Event]], None]) -> None:
        """The other way to read the stream: each step's events go to ``handler`` as they arrive,
        with no task woken per step; returns once the request ended, raises what ``handler``
        raised (the request is then aborted). Stopping early aborts the request, as iterating does."""
        self._handler, self._ended = handler, self._loop.create_future()
        try:
            while not self._queue.empty() and not self._ended.done():  # what came before
                self._push(self._queue.get_nowait())
            if not self._finished and not self._ended.done():
                await self._ended
            self._ended.result()
        finally:
            if self._ended.done() and not self._ended.cancelled():
                self._ended.exception()  # retrieved: raised above, or the caller stopped first
            self._handler = None
            self.cancel()

    def _push(self, outputs: list[CoreOutput]) -> None:
        assert self._handler is not None and self._ended is not None
        if self._ended.done():
            return  # the handler failed: nothing more is handed to it
        events = self._process(outputs)
        try:
            self._handler(events)
        except Exception as error:  # the caller's reason to end this request: it alone ends
            self._ended.set_exception(error)
            return
        if self._finished:
            self._ended.set_result(None)

    def _process(self, outputs: list[CoreOutput]) -> list[Event]:
        try:
            result = self._processor.process(outputs)
        except Exception as exc:  # this request's output failed: it alone ends
            log.exception("output processing failed for %s", self.key)
            self._finished = True
            self._engine.abort(self.key, failed=True)
            return [Failed(f"output processing failed: {type(exc).__name__}", self._processor.usage())]
        if result.stopped:
            self._engine.stop_choices(self.key, result.stopped)
        if result.done:
            self._finished = True  # the core has ended (or is told to end) every choice
        return coalesce(result.events)


class StreamOpener:
    """Opens each request's stream with its output processor, on the running event loop: the
    tokenizer's decoder and token texts and the text rules are built once, for every request."""

    def __init__(self, tokenizer: Any, rules: TextRules):
        self._decoder = fast_decoder(tokenizer)
        self._token_texts = TokenTexts(tokenizer)
        self._rules = rules

    def open(self, owner: StreamOwner, request: GenerationRequest, key: str) -> RequestStream:
        processor = RequestOutputProcessor(request, self._decoder, self._token_texts, self._rules)
        return RequestStream(owner, key, asyncio.get_running_loop(), processor)
