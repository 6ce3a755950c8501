"""Background Responses (``background: true``): stored as ``queued`` with their request and answered
at once, then run to their end in a task of the edge that took them (the caller may leave), their
lease renewed in the store; a cancel or delete through any edge stops them; an edge that stops
gives them back (:mod:`edge.surfaces.responses.resume` re-runs them); one naming a ``conversation``
appends its turn with its end, completed or incomplete. docs/http.md, "Stored Responses"."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from edge.errors import EdgeError
from edge.state import current_state
from edge.store.conversations import ConversationStore
from edge.store.database import Statement
from edge.store.events import EventStore
from edge.store.responses import ResponseStore, StoredResponse, now_ms
from edge.surfaces.answer import Translator, run_rewritten
from edge.surfaces.responses.events import EventLog
from edge.surfaces.responses.request import (
    ParsedResponsesRequest,
    build_responses_request,
    conversation_id,
    input_items,
    validate_responses_request,
)
from edge.surfaces.responses.stored import current_store, ended, record_of
from edge.surfaces.responses.translate import ResponsesTranslator
from edge.surfaces.responses.turns import turn_items

log = logging.getLogger("sluice.edge")


@dataclass(frozen=True)
class Lease:
    """How long an edge's claim on a running response lasts (``--state-lease``): an edge that
    crashed has its runs taken over this long after; its holder renews it every third of it."""

    seconds: float

    @property
    def ms(self) -> int:
        return int(self.seconds * 1000)

    @property
    def renew_s(self) -> float:
        return self.seconds / 3

    def until(self) -> int:
        """The lease's end if it starts now (Unix milliseconds)."""
        return now_ms() + self.ms


def current_lease() -> Lease:
    return Lease(current_state().settings.state_lease_s)


async def start(
    parsed: ParsedResponsesRequest,
    translator: Callable[[str], Translator],
    queued: dict[str, Any],
    owner: str,
    history: list[Any],
    body: dict[str, Any],
) -> None:
    """Stores ``queued`` (the Response with ``status: queued``) with its request ``body``, and
    starts its run; a streamed one's first event, ``response.queued``, is stored before."""
    store, lease = await current_store(), current_lease()
    record = record_of(parsed, queued, owner, history)
    record.request, record.lease_until = body, lease.until()
    log = None
    if parsed.stream:
        log = EventLog(await current_state().store.events(), record.id, 0)
        log.add([{"type": "response.queued", "sequence_number": 0, "response": queued}])
        await log.flush()
    await store.put(record)
    run = _Run(store, parsed, translator, record, history, lease, log)
    current_state().background.spawn(record.id, run.run())


async def rerun(store: ResponseStore, record: StoredResponse, lease: Lease) -> _Run:
    """The run of a stored background response, from its start: the same id, request and
    conversation (its earlier turns are the conversation before this turn's input); a streamed
    one's events numbered on after the stopped run's."""
    request = validate_responses_request(record.request)
    earlier = len(record.conversation) - len(input_items(request))
    history = record.conversation[:earlier]
    parsed = build_responses_request(request, history)
    echo = parsed.echo()

    def translator(model: str) -> ResponsesTranslator:
        return ResponsesTranslator(record.id, record.created_at, model, echo)

    log = None
    if parsed.stream:
        events = EventStore(store.database)
        log = EventLog(events, record.id, await events.last(record.id) + 1)
    return _Run(store, parsed, translator, record, history, lease, log)


class _Run:
    """One background response's run: ``in_progress``, the generation, its end written once."""

    def __init__(
        self,
        store: ResponseStore,
        parsed: ParsedResponsesRequest,
        translator: Callable[[str], Translator],
        record: StoredResponse,
        history: list[Any],
        lease: Lease,
        log: EventLog | None = None,
    ) -> None:
        self.store, self.parsed, self.translator = store, parsed, translator
        self.record, self.history, self.lease, self.log = record, history, lease, log

    async def run(self) -> None:
        """Runs the response; on a failure or a cancel its end says so (a cancel or delete already
        written stands: :meth:`ResponseStore.finish` changes nothing). When the edge stops (the
        task is cancelled while the response still runs in the store) it is given back:
        ``queued`` again with no lease, for this edge's restart or another edge to re-run. A
        streamed run's events are all stored before its end is written."""
        task = asyncio.current_task()
        assert task is not None
        helpers = [asyncio.create_task(self._renew(task))]
        if self.log is not None:
            helpers.append(asyncio.create_task(self.log.flushing()))
        try:
            await self._write("in_progress", self.record.response, self.lease.until())
            sink = self.log.add if self.log is not None else None
            result = await run_rewritten(self.parsed, self.translator, sink)
            await self._end(result["status"], result, self._turn(result))
        except EdgeError as error:
            failure = {"code": str(error.code or error.type), "message": error.message}
            await self._end("failed", ended(self.record.response, "failed", failure))
        except asyncio.CancelledError:
            await self._end("queued", self.record.response)
            raise
        finally:
            for helper in helpers:
                helper.cancel()

    async def _end(self, status: str, response: dict[str, Any], along: Sequence[Statement] = ()) -> None:
        """Writes the events still kept, then ``status`` with no lease (and ``along`` with it)."""
        if self.log is not None:
            await self.log.flush()
        await self._write(status, response, 0, along)

    async def _write(
        self, status: str, response: dict[str, Any], lease_until: int, along: Sequence[Statement] = ()
    ) -> None:
        record = record_of(self.parsed, {**response, "status": status}, self.record.owner, self.history)
        record.request, record.lease_until = self.record.request, lease_until
        await self.store.finish(record, along)

    def _turn(self, result: dict[str, Any]) -> list[Statement]:
        """The append of this turn to the conversation the request names (none: no statements),
        written with the run's end: only if this run writes it (a response cancelled, deleted or
        ended by another run meanwhile appends nothing), and seen by every poll that sees it."""
        conversation = conversation_id(self.parsed.request)
        if conversation is None:
            return []
        store = ConversationStore(self.store.database, self.store.retention.ttl_s)
        only_if = self.store.still_running(self.record.id)
        return store.appending(conversation, turn_items(self.parsed, result), only_if)

    async def _renew(self, task: asyncio.Task[None]) -> None:
        """Renews the lease every third of it; cancels ``task`` once the response is no longer
        running in the store (cancelled or deleted through another edge)."""
        while True:
            await asyncio.sleep(self.lease.renew_s)
            try:
                running = await self.store.renew(self.record.id, self.lease.until())
            except Exception:  # the database is away for a moment: try again next time
                log.exception("renewing background response %s failed", self.record.id)
                continue
            if not running:
                task.cancel()
                return
