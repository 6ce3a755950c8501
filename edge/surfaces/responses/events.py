"""Streamed background Responses (``background: true, stream: true``): the run writes its stream
events to the store as it makes them (:class:`EventLog`), and every stream of it, the creating
request's or a reconnection's (``GET /v1/responses/{id}?stream=true&starting_after=N``), reads
them from there (:func:`event_stream`), so any edge sharing the store serves it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from quart.wrappers import Response

from edge.state import EdgeState, current_state
from edge.store.events import EventStore
from edge.store.responses import RUNNING
from edge.streaming import sse

#: The events that end a stream.
TERMINAL = ("response.completed", "response.incomplete", "response.failed")
#: How often a run writes the events it made since the last write, and a stream looks for new ones.
FLUSH_S = 0.05
POLL_S = 0.1


class EventLog:
    """A run's events on their way to the store, numbered on from ``next_seq`` (a re-run's follow
    the stopped run's)."""

    def __init__(self, events: EventStore, response_id: str, next_seq: int) -> None:
        self.events, self.response_id, self.next_seq = events, response_id, next_seq
        self._pending: list[dict[str, Any]] = []
        # One write at a time, in order: a run's last flush waits for the flusher's (a stream
        # that reads the run's end must find every event before it).
        self._writing = asyncio.Lock()

    def add(self, events: list[dict[str, Any]]) -> None:
        """Numbers ``events`` and keeps them for the next :meth:`flush`."""
        for event in events:
            self._pending.append({**event, "sequence_number": self.next_seq})
            self.next_seq += 1

    async def flush(self) -> None:
        """Writes the events kept since the last flush."""
        async with self._writing:
            pending, self._pending = self._pending, []
            await self.events.append(self.response_id, pending)

    async def flushing(self) -> None:
        """Flushes every :data:`FLUSH_S` until cancelled."""
        while True:
            await asyncio.sleep(FLUSH_S)
            await self.flush()


def event_stream(response_id: str, owner: str, after: int) -> Response:
    """The 200 stream of the owner's response's events numbered above ``after``, until its last
    event, the response's end, or this edge's drain (the client reconnects elsewhere)."""
    body = _frames(current_state(), response_id, owner, after)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return Response(body, content_type="text/event-stream", headers=headers)


async def _frames(state: EdgeState, response_id: str, owner: str, after: int) -> AsyncIterator[bytes]:
    """The stream's frames; a ``: heartbeat`` comment after ``--heartbeat-interval`` of silence."""
    store = await state.store.get()
    events = await state.store.events()
    quiet_since = time.monotonic()
    while not state.drain.draining:
        found = await events.after(response_id, after)
        for event in found:
            yield sse.named_frame(event)
            if event["type"] in TERMINAL:
                return
        if found:
            after, quiet_since = found[-1]["sequence_number"], time.monotonic()
            continue
        record = await store.get(response_id, owner)
        if record is None or record.status not in RUNNING:  # deleted, cancelled, or ended
            if not await events.after(response_id, after):
                return
            continue
        if time.monotonic() - quiet_since >= state.settings.heartbeat_interval_s:
            yield sse.HEARTBEAT_FRAME
            quiet_since = time.monotonic()
        await asyncio.sleep(POLL_S)
