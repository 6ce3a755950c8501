"""Stored Responses: one row per response, readable only by the key that made it, kept until
``--state-ttl`` after its creation and within ``--state-max-bytes`` (:mod:`edge.store.budget`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from edge.store.database import Database, Statement, json_text, json_value

#: A background response's statuses while it runs; the others are final.
RUNNING = ("queued", "in_progress")
_COLUMNS = (
    "id, owner, created_at, status, background, lease_until, response, input_items, conversation, "
    "request, reruns"
)
#: How many running responses one search of :meth:`ResponseStore.take_over` claims at most.
TAKEOVER_BATCH = 16


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class StoredResponse:
    """One stored response: the Response object as answered, this turn's input items, and the
    conversation so far (earlier turns, this input, this output: what a continuation sends); a
    background one also keeps its request body (what a re-run sends) and how often it was re-run."""

    id: str
    owner: str
    created_at: int
    status: str
    background: bool
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    conversation: list[dict[str, Any]]
    lease_until: int = 0
    request: dict[str, Any] = field(default_factory=dict)
    reruns: int = 0

    def size(self) -> int:
        """Bytes this row holds (its JSON columns), counted against ``--state-max-bytes``."""
        return sum(len(part) for part in self._json())

    def _json(self) -> tuple[bytes, bytes, bytes, bytes]:
        return (
            json_text(self.response).encode(),
            json_text(self.input_items).encode(),
            json_text(self.conversation).encode(),
            json_text(self.request).encode(),
        )


@dataclass(frozen=True)
class Retention:
    """How long responses are kept (``ttl_s``) and how many bytes responses, their stream events
    and conversations may hold in all (``max_bytes``, 0 = no limit: :mod:`edge.store.budget`)."""

    ttl_s: float
    max_bytes: int


class ResponseStore:
    """The ``responses`` table's operations; every read and change names the owner."""

    def __init__(self, database: Database, retention: Retention) -> None:
        self.database = database
        self.retention = retention

    async def put(self, record: StoredResponse) -> None:
        """Inserts ``record`` (expiring ``ttl`` after its creation)."""
        response, items, conversation, body = record._json()
        expires = record.created_at * 1000 + int(self.retention.ttl_s * 1000)
        await self.database.execute(
            f"INSERT INTO responses ({_COLUMNS}, expires_at, size_bytes) VALUES ({', '.join('?' * 13)})",
            (
                record.id,
                record.owner,
                record.created_at,
                record.status,
                int(record.background),
                record.lease_until,
                response.decode(),
                items.decode(),
                conversation.decode(),
                body.decode(),
                record.reruns,
                expires,
                record.size(),
            ),
        )

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The owner's unexpired response ``response_id``, else None (another key's too)."""
        rows = await self.database.fetch(
            f"SELECT {_COLUMNS} FROM responses WHERE id = ? AND owner = ? AND expires_at > ?",
            (response_id, owner, now_ms()),
        )
        return _record(rows[0]) if rows else None

    async def delete(self, response_id: str, owner: str) -> bool:
        """Deletes the owner's response (and its stream events); False when there is none."""
        changed = await self.database.execute(
            "DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)
        )
        if changed:
            await self.database.execute("DELETE FROM response_events WHERE response_id = ?", (response_id,))
        return changed > 0

    async def finish(self, record: StoredResponse, along: Sequence[Statement] = ()) -> bool:
        """Writes a running response's new state (final, or ``in_progress`` with its lease); False
        when it is no longer running (cancelled, deleted or expired meanwhile): nothing changes.
        ``along``, statements that check :meth:`still_running`, run in the same transaction
        before it, the response's row locked: they take effect exactly when the state is written."""
        response, _, conversation, _ = record._json()
        write: Statement = (
            "UPDATE responses SET status = ?, response = ?, conversation = ?, size_bytes = ?, "
            f"lease_until = ? WHERE id = ? AND status IN {_RUNNING_SQL}",
            (
                record.status,
                response.decode(),
                conversation.decode(),
                record.size(),
                record.lease_until,
                record.id,
            ),
        )
        if not along:
            return await self.database.execute(*write) > 0
        lock: Statement = (
            f"UPDATE responses SET lease_until = lease_until WHERE id = ? AND status IN {_RUNNING_SQL}",
            (record.id,),
        )
        return (await self.database.transaction([lock, *along, write]))[-1] > 0

    @staticmethod
    def still_running(response_id: str) -> Statement:
        """An SQL condition (and its parameters): the response is still running."""
        return f"EXISTS (SELECT 1 FROM responses WHERE id = ? AND status IN {_RUNNING_SQL})", [response_id]

    async def cancel(self, response_id: str, owner: str, response: dict[str, Any]) -> bool:
        """Marks the owner's running background response ``cancelled`` with ``response``; False
        when it is not running (then nothing changes)."""
        changed = await self.database.execute(
            "UPDATE responses SET status = 'cancelled', response = ?, lease_until = 0 "
            f"WHERE id = ? AND owner = ? AND background = 1 AND status IN {_RUNNING_SQL}",
            (json_text(response), response_id, owner),
        )
        return changed > 0

    async def renew(self, response_id: str, lease_until: int) -> bool:
        """Extends a running response's lease; False when it is no longer running."""
        changed = await self.database.execute(
            f"UPDATE responses SET lease_until = ? WHERE id = ? AND status IN {_RUNNING_SQL}",
            (lease_until, response_id),
        )
        return changed > 0

    async def take_over(self, lease_until: int) -> list[StoredResponse]:
        """Claims running background responses whose lease ran out (their edge stopped or crashed
        without ending them), each for one caller even among several edges: their lease becomes
        ``lease_until`` and their ``reruns`` one more; the claimed records."""
        now = now_ms()
        rows = await self.database.fetch(
            f"SELECT id FROM responses WHERE status IN {_RUNNING_SQL} AND lease_until < ? "
            f"AND background = 1 ORDER BY lease_until LIMIT {TAKEOVER_BATCH}",
            (now,),
        )
        claimed = []
        for (identifier,) in rows:
            changed = await self.database.execute(
                "UPDATE responses SET lease_until = ?, reruns = reruns + 1 "
                f"WHERE id = ? AND status IN {_RUNNING_SQL} AND lease_until < ?",
                (lease_until, identifier, now),
            )
            if changed:
                found = await self.database.fetch(
                    f"SELECT {_COLUMNS} FROM responses WHERE id = ?", (identifier,)
                )
                claimed += [_record(row) for row in found]
        return claimed

    async def purge(self) -> int:
        """Deletes the expired responses; how many."""
        return await self.database.execute("DELETE FROM responses WHERE expires_at <= ?", (now_ms(),))


_RUNNING_SQL = "(" + ", ".join(f"'{status}'" for status in RUNNING) + ")"


def _record(row: tuple[Any, ...]) -> StoredResponse:
    identifier, owner, created_at, status, background, lease, response, items, conversation, body, reruns = (
        row
    )
    return StoredResponse(
        id=identifier,
        owner=owner,
        created_at=int(created_at),
        status=status,
        background=bool(background),
        response=json_value(response),
        input_items=json_value(items),
        conversation=json_value(conversation),
        lease_until=int(lease),
        request=json_value(body),
        reruns=int(reruns),
    )
