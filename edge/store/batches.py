"""Batches of the Batch API: the Batch object by owner, its status changed only from the status
it is known to have (so two edges never both make one transition), and its lines, each claimed
by one edge under a lease and given its result once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from edge.store.database import Database, json_text, json_value
from edge.store.responses import now_ms

#: The statuses a batch is worked on in; the others are final.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
_COLUMNS = "id, owner, created_at, expires_at, status, lease_until, batch"
# Lines inserted per statement (each line binds 9 values; SQLite allows 32766).
_INSERT_ROWS = 200
# A line waiting for an edge, or running on one whose lease ran out (it stopped or hung).
_CLAIMABLE = "(status = 'pending' OR (status = 'running' AND lease_until < ?))"


@dataclass
class BatchRecord:
    """One batch: the Batch object as last written (``batch``) and where its work stands."""

    id: str
    owner: str
    created_at: int  # milliseconds (the Batch object's ``created_at`` is in seconds)
    expires_at: int  # milliseconds: the end of its completion window
    status: str
    lease_until: int
    batch: dict[str, Any]


@dataclass(frozen=True)
class LineResult:
    """A line's state at the end: ``done`` (``ok``: a 2xx answer), ``skipped`` (cancelled before
    it ran) or ``expired``; ``result`` is its output line (empty when it has none)."""

    line: int
    custom_id: str
    status: str
    ok: bool
    result: str


class BatchStore:
    """The ``batches`` and ``batch_lines`` tables' operations."""

    def __init__(self, database: Database, ttl_s: float) -> None:
        self.database = database
        self.ttl_s = ttl_s

    async def create(self, record: BatchRecord) -> None:
        await self.database.execute(
            f"INSERT INTO batches ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                record.id,
                record.owner,
                record.created_at,
                record.expires_at,
                record.status,
                record.lease_until,
                json_text(record.batch),
            ),
        )

    async def get(self, batch_id: str, owner: str | None) -> BatchRecord | None:
        """The batch ``batch_id`` of ``owner`` (of anyone: None, for the runner), else None."""
        where, params = "id = ?", list[Any]([batch_id])
        if owner is not None:
            where, params = where + " AND owner = ?", [*params, owner]
        rows = await self.database.fetch(f"SELECT {_COLUMNS} FROM batches WHERE {where}", params)
        return _batch(rows[0]) if rows else None

    async def page(self, owner: str, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """A page of the owner's batches, newest first, starting after the batch ``after``;
        whether more follow."""
        where, params = "owner = ?", list[Any]([owner])
        if after is not None:
            anchor = await self.get(after, owner)
            created = anchor.created_at if anchor is not None else 0
            where += " AND (created_at < ? OR (created_at = ? AND id < ?))"
            params += [created, created, after]
        rows = await self.database.fetch(
            f"SELECT {_COLUMNS} FROM batches WHERE {where} ORDER BY created_at DESC, id DESC LIMIT ?",
            [*params, limit + 1],
        )
        return [_batch(row) for row in rows[:limit]], len(rows) > limit

    async def active(self) -> list[BatchRecord]:
        """Every batch still worked on, oldest first (the runner's view: all owners)."""
        marks = ", ".join("?" * len(ACTIVE))
        rows = await self.database.fetch(
            f"SELECT {_COLUMNS} FROM batches WHERE status IN ({marks}) ORDER BY created_at, id", ACTIVE
        )
        return [_batch(row) for row in rows]

    async def transition(
        self, batch_id: str, since: Sequence[str], batch: dict[str, Any], lease_until: int = 0
    ) -> bool:
        """Writes ``batch`` (its ``status`` the new one) if the batch's status is one of ``since``;
        False (nothing changed) when another edge or a cancel changed it first."""
        marks = ", ".join("?" * len(since))
        changed = await self.database.execute(
            f"UPDATE batches SET status = ?, batch = ?, lease_until = ? WHERE id = ? AND status IN ({marks})",
            (batch["status"], json_text(batch), lease_until, batch_id, *since),
        )
        return changed > 0

    async def claim(self, batch_id: str, status: str, lease_until: int) -> bool:
        """Takes the batch's step (validating, finalizing) for this edge until ``lease_until``,
        unless another edge holds it."""
        changed = await self.database.execute(
            "UPDATE batches SET lease_until = ? WHERE id = ? AND status = ? AND lease_until < ?",
            (lease_until, batch_id, status, now_ms()),
        )
        return changed > 0

    async def add_lines(self, batch_id: str, lines: Sequence[tuple[str, str]]) -> None:
        """Stores the batch's lines (``custom_id``, body JSON), numbered from 1, pending; lines
        stored before (a validation that stopped halfway) are replaced."""
        await self.database.execute("DELETE FROM batch_lines WHERE batch_id = ?", (batch_id,))
        for start in range(0, len(lines), _INSERT_ROWS):
            chunk = lines[start : start + _INSERT_ROWS]
            params: list[Any] = []
            for number, (custom_id, body) in enumerate(chunk, start + 1):
                params += [batch_id, number, custom_id, body, "pending", "", 0, 0, ""]
            rows = ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?, ?)"] * len(chunk))
            await self.database.execute(
                "INSERT INTO batch_lines (batch_id, line, custom_id, body, status, claim, lease_until, "
                f"ok, result) VALUES {rows}",
                params,
            )

    async def claim_lines(
        self, batch_id: str, claim: str, count: int, lease_until: int
    ) -> list[tuple[int, str, str]]:
        """Claims up to ``count`` claimable lines, lowest numbers first, as ``claim`` until
        ``lease_until``: their (line, custom_id, body). The claimable test is repeated on the row
        itself, so of two edges claiming at once each line goes to one."""
        now = now_ms()
        await self.database.execute(
            f"UPDATE batch_lines SET status = 'running', claim = ?, lease_until = ? "
            f"WHERE batch_id = ? AND {_CLAIMABLE} AND line IN (SELECT line FROM batch_lines "
            f"WHERE batch_id = ? AND {_CLAIMABLE} ORDER BY line LIMIT ?)",
            (claim, lease_until, batch_id, now, batch_id, now, count),
        )
        rows = await self.database.fetch(
            "SELECT line, custom_id, body FROM batch_lines WHERE batch_id = ? AND claim = ? "
            "AND status = 'running' ORDER BY line",
            (batch_id, claim),
        )
        return [(int(line), str(custom_id), str(body)) for line, custom_id, body in rows]

    async def renew_lines(self, claims: Sequence[str], lease_until: int) -> None:
        """Extends the leases of the lines this edge runs (by their claims)."""
        if claims:
            marks = ", ".join("?" * len(claims))
            await self.database.execute(
                f"UPDATE batch_lines SET lease_until = ? WHERE status = 'running' AND claim IN ({marks})",
                (lease_until, *claims),
            )

    async def finish_line(self, batch_id: str, line: int, claim: str, ok: bool, result: str) -> bool:
        """Writes a line's result if ``claim`` still holds it; False (nothing written) when its
        lease ran out and another edge took it."""
        changed = await self.database.execute(
            "UPDATE batch_lines SET status = 'done', ok = ?, result = ?, lease_until = 0 "
            "WHERE batch_id = ? AND line = ? AND claim = ? AND status = 'running'",
            (int(ok), result, batch_id, line, claim),
        )
        return changed > 0

    async def release_line(self, batch_id: str, line: int, claim: str) -> None:
        """Gives a line back unanswered (its edge stops): pending again, for any edge."""
        await self.database.execute(
            "UPDATE batch_lines SET status = 'pending', claim = '', lease_until = 0 "
            "WHERE batch_id = ? AND line = ? AND claim = ? AND status = 'running'",
            (batch_id, line, claim),
        )

    async def end_pending(self, batch_id: str, status: str) -> int:
        """Ends the lines not started, and those of an edge that stopped without giving them back
        (``skipped`` on a cancel, ``expired`` at the window's end)."""
        return await self.database.execute(
            f"UPDATE batch_lines SET status = ?, lease_until = 0 WHERE batch_id = ? AND {_CLAIMABLE}",
            (status, batch_id, now_ms()),
        )

    async def counts(self, batch_id: str) -> dict[str, int]:
        """How many lines are in each status (``done`` split into ``ok`` and ``failed``)."""
        rows = await self.database.fetch(
            "SELECT status, ok, COUNT(*) FROM batch_lines WHERE batch_id = ? GROUP BY status, ok",
            (batch_id,),
        )
        counts: dict[str, int] = {}
        for status, ok, count in rows:
            key = ("ok" if ok else "failed") if status == "done" else str(status)
            counts[key] = counts.get(key, 0) + int(count)
        return counts

    async def results(self, batch_id: str) -> list[LineResult]:
        """Every line's end, in line order."""
        rows = await self.database.fetch(
            "SELECT line, custom_id, status, ok, result FROM batch_lines WHERE batch_id = ? ORDER BY line",
            (batch_id,),
        )
        return [LineResult(int(n), str(c), str(s), bool(ok), str(r)) for n, c, s, ok, r in rows]

    async def purge(self) -> int:
        """Deletes the batches created more than the store's ttl ago, and their lines."""
        cutoff = now_ms() - int(self.ttl_s * 1000)
        deleted = await self.database.execute("DELETE FROM batches WHERE created_at < ?", (cutoff,))
        await self.database.execute(
            "DELETE FROM batch_lines WHERE batch_id NOT IN (SELECT id FROM batches)", ()
        )
        return deleted


def _batch(row: tuple[Any, ...]) -> BatchRecord:
    identifier, owner, created_at, expires_at, status, lease, batch = row
    return BatchRecord(
        identifier, owner, int(created_at), int(expires_at), status, int(lease), json_value(batch)
    )
