"""Background Responses (``background: true``): stored as ``queued`` and answered at once, then
run to their end in a task of the edge that took them (the caller may leave), their lease renewed
in the store; a cancel or delete through any edge stops them. docs/edge-internals.md, "Stored Responses"."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from edge.errors import EdgeError
from edge.state import current_state
from edge.store.responses import ResponseStore, StoredResponse, now_ms
from edge.surfaces.answer import Translator, run_rewritten
from edge.surfaces.responses.request import ParsedResponsesRequest
from edge.surfaces.responses.stored import current_store, edge_stopped, ended, record_of

log = logging.getLogger("sluice.edge")
#: How long a running response's lease lasts, and how often its edge renews it: an edge that
#: stopped without ending its runs has them read as failed this long after.
LEASE_MS = 30_000
RENEW_S = 10.0


async def start(
    parsed: ParsedResponsesRequest,
    translator: Callable[[str], Translator],
    queued: dict[str, Any],
    owner: str,
    history: list[Any],
) -> None:
    """Stores ``queued`` (the Response with ``status: queued``) and starts its run."""
    store = await current_store()
    record = record_of(parsed, queued, owner, history)
    record.lease_until = now_ms() + LEASE_MS
    await store.put(record)
    run = _Run(store, parsed, translator, record, history)
    current_state().background.spawn(record.id, run.run())


class _Run:
    """One background response's run: ``in_progress``, the generation, its end written once."""

    def __init__(
        self,
        store: ResponseStore,
        parsed: ParsedResponsesRequest,
        translator: Callable[[str], Translator],
        record: StoredResponse,
        history: list[Any],
    ) -> None:
        self.store, self.parsed, self.translator = store, parsed, translator
        self.record, self.history = record, history

    async def run(self) -> None:
        """Runs the response; on a failure, a cancel or the edge's shutdown its end says so (a
        cancel or delete already written stands: :meth:`ResponseStore.finish` changes nothing)."""
        task = asyncio.current_task()
        assert task is not None
        renewal = asyncio.create_task(self._renew(task))
        try:
            await self._write("in_progress", self.record.response, now_ms() + LEASE_MS)
            result = await run_rewritten(self.parsed, self.translator)
            await self._write(result["status"], result, 0)
        except EdgeError as error:
            failure = {"code": str(error.code or error.type), "message": error.message}
            await self._write("failed", ended(self.record.response, "failed", failure), 0)
        except asyncio.CancelledError:
            await self._write("failed", ended(self.record.response, "failed", edge_stopped()), 0)
            raise
        finally:
            renewal.cancel()

    async def _write(self, status: str, response: dict[str, Any], lease_until: int) -> None:
        record = record_of(self.parsed, {**response, "status": status}, self.record.owner, self.history)
        record.lease_until = lease_until
        await self.store.finish(record)

    async def _renew(self, task: asyncio.Task[None]) -> None:
        """Renews the lease every :data:`RENEW_S`; cancels ``task`` once the response is no
        longer running in the store (cancelled or deleted through another edge)."""
        while True:
            await asyncio.sleep(RENEW_S)
            try:
                running = await self.store.renew(self.record.id, now_ms() + LEASE_MS)
            except Exception:  # the database is away for a moment: try again next time
                log.exception("renewing background response %s failed", self.record.id)
                continue
            if not running:
                task.cancel()
                return
