"""The batch runner of one edge process: validates new batches, claims their lines from the store
(at most ``--batch-concurrency`` at once, leases renewed), sends each through the edge's own app
at ``--batch-priority`` and writes its result once, then writes the output and error files.
Several edges share the work through the store; one that stops lets its running lines end within
``--graceful-timeout`` and gives the rest back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import replace
from typing import Any

import orjson
from quart import Quart

from edge.state import app_state
from edge.store.batches import BatchRecord, BatchStore
from edge.store.files import StoredFile
from edge.store.responses import now_ms
from edge.surfaces.batches import dispatch
from edge.surfaces.batches.lines import parse_lines
from edge.surfaces.batches.objects import answered_line, moved, request_counts, unanswered_line

log = logging.getLogger("sluice.edge")
#: How long a claim (a line, a batch's validation or finalization) lasts, and how often the
#: runner renews its lines' claims: an edge that crashed has its lines taken over this long after.
LEASE_MS = 60_000
RENEW_S = 15.0
#: How often the runner looks for work when nothing woke it.
POLL_S = 1.0
#: Answers that say "not now" (rate limits, a full queue, a draining edge): the line is given back
#: and runs later, never written as failed.
RETRY_STATUSES = (429, 503)
_EXPIRED = "This request was not run before the batch's completion window ended."


class BatchRunner:
    """Runs the batches of the store, with the other edges that share it."""

    def __init__(self, app: Quart) -> None:
        self.app = app
        self.state = app_state(app)
        self._running: dict[tuple[str, int], tuple[str, asyncio.Task[None]]] = {}
        self._wake = asyncio.Event()

    async def run(self) -> None:
        """Works until cancelled (the edge stops); then gives back the lines still running."""
        renewal = asyncio.create_task(self._renew())
        try:
            while True:
                if not self.state.drain.draining:
                    try:
                        await self._round()
                    except Exception:  # a database hiccup must not end the runner
                        log.exception("the batch runner's round failed")
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), POLL_S)
        finally:
            try:
                await self._wind_down()
            finally:
                renewal.cancel()

    async def _wind_down(self) -> None:
        """The edge stops: the lines it runs get ``--graceful-timeout`` to end and be written (the
        leases renewed meanwhile); the rest are cancelled and given back. Cancelling a line whose
        request the worker was finishing would have it run to its end twice."""
        tasks = [task for _, task in self._running.values()]
        if tasks:
            grace = self.state.settings.graceful_timeout_s
            log.info("batch runner: %d line(s) running get %.1f s to end", len(tasks), grace)
            await asyncio.wait(tasks, timeout=grace)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _round(self) -> None:
        store = await self.state.store.batches()
        for batch in await store.active():
            if batch.status == "validating":
                await self._validate(store, batch)
            elif batch.status == "finalizing":  # its edge stopped while finalizing it
                if await store.claim(batch.id, "finalizing", now_ms() + LEASE_MS):
                    await self._finalize(store, batch)
            else:
                await self._advance(store, batch)

    async def _validate(self, store: BatchStore, batch: BatchRecord) -> None:
        """Checks the input file: the batch fails with its errors, or its lines are stored and it
        is ``in_progress``."""
        if not await store.claim(batch.id, "validating", now_ms() + LEASE_MS):
            return
        files = await self.state.store.files()
        content = await files.content(batch.batch["input_file_id"], batch.owner)
        if content is None:
            message = f"The input file '{batch.batch['input_file_id']}' no longer exists."
            errors = [{"code": "invalid_file", "message": message, "param": "input_file_id", "line": None}]
        else:
            lines, errors = await asyncio.to_thread(parse_lines, content, batch.batch["endpoint"])
        if errors:
            failed = moved(batch.batch, "failed", errors={"object": "list", "data": errors})
            await store.transition(batch.id, ("validating",), failed)
            return
        await store.add_lines(
            batch.id, [(line.custom_id, orjson.dumps(line.body).decode()) for line in lines]
        )
        counts = {"total": len(lines), "completed": 0, "failed": 0}
        await store.transition(
            batch.id, ("validating",), moved(batch.batch, "in_progress", request_counts=counts)
        )

    async def _advance(self, store: BatchStore, batch: BatchRecord) -> None:
        """Claims lines of a running batch (ends the pending ones of a cancelled or expired one);
        finalizes it once no line is left."""
        expired = batch.status == "in_progress" and now_ms() >= batch.expires_at
        if batch.status == "cancelling" or expired:
            await store.end_pending(batch.id, "expired" if expired else "skipped")
        else:
            await self._claim(store, batch)
        counts = await store.counts(batch.id)
        if counts.get("pending", 0) or counts.get("running", 0):
            return
        if batch.status == "cancelling":  # one edge writes its files: the one that claims it
            if await store.claim(batch.id, "cancelling", now_ms() + LEASE_MS):
                await self._finalize(store, batch)
            return
        finalizing = moved(batch.batch, "finalizing")
        if await store.transition(batch.id, ("in_progress",), finalizing, now_ms() + LEASE_MS):
            await self._finalize(store, replace(batch, status="finalizing", batch=finalizing))

    async def _claim(self, store: BatchStore, batch: BatchRecord) -> None:
        free = self.state.settings.batch_concurrency - len(self._running)
        if free <= 0 or self.state.drain.draining:  # a round under way when the edge began to stop
            return
        claim = uuid.uuid4().hex
        for line, custom_id, body in await store.claim_lines(batch.id, claim, free, now_ms() + LEASE_MS):
            task = asyncio.create_task(self._run_line(store, batch, claim, line, custom_id, body))
            self._running[(batch.id, line)] = (claim, task)

    async def _run_line(
        self, store: BatchStore, batch: BatchRecord, claim: str, line: int, custom_id: str, body: str
    ) -> None:
        """Sends one line and writes its result (or gives it back: "not now", or the edge stops)."""
        answered = False  # once the worker has answered, the line is written, never given back
        try:
            sent = self._prioritized(batch.batch["endpoint"], orjson.loads(body))
            answer = await dispatch.send(self.app, batch.batch["endpoint"], sent, batch.owner)
            if answer.status in RETRY_STATUSES:
                await store.release_line(batch.id, line, claim)
                return
            result = orjson.dumps(answered_line(custom_id, answer)).decode()
            # Written even if the edge stops meanwhile (given back instead, a restarted edge would
            # run the line to its end a second time).
            answered = True
            write = asyncio.ensure_future(
                store.finish_line(batch.id, line, claim, 200 <= answer.status < 300, result)
            )
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                await write
                raise
            self._wake.set()
        except asyncio.CancelledError:
            if not answered:
                await store.release_line(batch.id, line, claim)
            raise
        except Exception:
            log.exception("batch %s line %d failed; it runs again later", batch.id, line)
            await store.release_line(batch.id, line, claim)
        finally:
            # Given back, the line may already run again here under a new claim: that entry stays.
            entry = self._running.get((batch.id, line))
            if entry is not None and entry[0] == claim:
                del self._running[(batch.id, line)]

    def _prioritized(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        """A generation line's body at ``--batch-priority`` (or its own, if lower still)."""
        if endpoint == "/v1/embeddings":
            return body
        own = body.get("priority")
        lowest = self.state.settings.batch_priority
        return {**body, "priority": max(own, lowest) if isinstance(own, int) else lowest}

    async def _finalize(self, store: BatchStore, batch: BatchRecord) -> None:
        """Writes the output and error files and the batch's final status: ``cancelled`` after a
        cancel, ``expired`` when lines expired, else ``completed``."""
        output: list[str] = []
        errors: list[str] = []
        for result in await store.results(batch.id):
            if result.status == "done":
                (output if result.ok else errors).append(result.result)
            elif result.status == "expired":
                errors.append(
                    orjson.dumps(unanswered_line(result.custom_id, "batch_expired", _EXPIRED)).decode()
                )
        counts = await store.counts(batch.id)
        files = {
            "output_file_id": await self._file(batch, "output", output),
            "error_file_id": await self._file(batch, "error", errors),
            "request_counts": request_counts(counts),
        }
        status = (
            "cancelled"
            if batch.status == "cancelling"
            else "expired"
            if counts.get("expired")
            else "completed"
        )
        await store.transition(batch.id, (batch.status,), moved(batch.batch, status, **files))

    async def _file(self, batch: BatchRecord, kind: str, lines: list[str]) -> str | None:
        """Stores one of the batch's files (an id of its own, so writing it again replaces it)."""
        if not lines:
            return None
        files = await self.state.store.files()
        content = "".join(line + "\n" for line in lines)
        file_id = f"file-{batch.id.removeprefix('batch_')}{kind[:3]}"
        stored = StoredFile(
            file_id,
            batch.owner,
            int(now_ms() // 1000),
            files.expiry(),
            "batch_output",
            f"{batch.id}_{kind}.jsonl",
            len(content.encode()),
        )
        await files.put(stored, content)
        return file_id

    async def _renew(self) -> None:
        """Renews the claims of the lines this edge runs, every :data:`RENEW_S`."""
        while True:
            await asyncio.sleep(RENEW_S)
            claims = sorted({claim for claim, _ in self._running.values()})
            try:
                await (await self.state.store.batches()).renew_lines(claims, now_ms() + LEASE_MS)
            except Exception:  # the database is away for a moment: try again next time
                log.exception("renewing the batch lines' claims failed")
