"""Background responses whose edge stopped before they ended (given back at a graceful stop, or
left with a lease that ran out by a crash) are re-run from their start by an edge that finds them
in the store: each edge looks every third of ``--state-lease``. One stopped again after
:data:`MAX_RERUNS` re-runs ends ``failed``. docs/http.md, "Stored Responses"."""

from __future__ import annotations

import asyncio
import logging

from quart import Quart

from edge.errors import EdgeError
from edge.state import app_state
from edge.store.responses import ResponseStore, StoredResponse
from edge.surfaces.responses.background import Lease, rerun
from edge.surfaces.responses.stored import ended

log = logging.getLogger("sluice.edge")
#: How many times a background response is re-run before it ends ``failed`` (an edge that
#: crashes on it each time must not bring the next edge down too).
MAX_RERUNS = 3


class Resumer:
    """Takes over the background responses that no edge runs, and runs them in this edge."""

    def __init__(self, app: Quart) -> None:
        self.app = app
        self.state = app_state(app)
        self.lease = Lease(self.state.settings.state_lease_s)

    async def run(self) -> None:
        """Looks for work until cancelled (the edge stops); not while the edge drains."""
        while True:
            if not self.state.drain.draining:
                try:
                    await self.round()
                except Exception:  # a database hiccup must not end the resumer
                    log.exception("taking over background responses failed")
            await asyncio.sleep(self.lease.renew_s)

    async def round(self) -> None:
        """Claims what no edge runs and starts each in a background task of its own."""
        store = await self.state.store.get()
        for record in await store.take_over(self.lease.until()):
            if record.reruns > MAX_RERUNS:
                await _give_up(store, record)
                continue
            log.info("re-running background response %s (its edge stopped before it ended)", record.id)
            self.state.background.spawn(record.id, self._rerun(store, record))

    async def _rerun(self, store: ResponseStore, record: StoredResponse) -> None:
        """Runs ``record`` again in a request context of this app (no client request has one)."""
        async with self.app.test_request_context("/v1/responses", method="POST"):
            try:
                run = await rerun(store, record, self.lease)
            except EdgeError as error:  # its request no longer passes this edge's checks
                await _fail(store, record, str(error.code or error.type), error.message)
                return
            await run.run()


async def _give_up(store: ResponseStore, record: StoredResponse) -> None:
    message = (
        f"The edges running this background response stopped {MAX_RERUNS + 1} times before it "
        "ended; send it again."
    )
    log.error("background response %s failed: %s", record.id, message)
    await _fail(store, record, "server_error", message)


async def _fail(store: ResponseStore, record: StoredResponse, code: str, message: str) -> None:
    """Ends ``record`` ``failed`` with ``code`` and ``message``."""
    record.response = ended(record.response, "failed", {"code": code, "message": message})
    record.status, record.lease_until = "failed", 0
    await store.finish(record)
