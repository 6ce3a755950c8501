"""The stream events of background responses run with ``stream: true``: appended as they are made,
read after a sequence number (a client reconnecting with ``starting_after``), deleted with their
response, counted with it against ``--state-max-bytes`` (:mod:`edge.store.budget`)."""

from __future__ import annotations

from typing import Any

from edge.store.database import Database, json_text, json_value


class EventStore:
    """The ``response_events`` table's operations. Reads name no owner: a caller reads the owner's
    response first (:meth:`edge.store.responses.ResponseStore.get`)."""

    def __init__(self, database: Database) -> None:
        self.database = database

    async def append(self, response_id: str, events: list[dict[str, Any]]) -> None:
        """Stores ``events``, each under its ``sequence_number``, in one statement."""
        if not events:
            return
        values = ", ".join(["(?, ?, ?, ?)"] * len(events))
        params: list[Any] = []
        for event in events:
            text = json_text(event)
            params += [response_id, int(event["sequence_number"]), text, len(text.encode())]
        await self.database.execute(
            f"INSERT INTO response_events (response_id, seq, event, size_bytes) VALUES {values}", params
        )

    async def after(self, response_id: str, seq: int) -> list[dict[str, Any]]:
        """The response's events numbered above ``seq``, in order."""
        rows = await self.database.fetch(
            "SELECT event FROM response_events WHERE response_id = ? AND seq > ? ORDER BY seq",
            (response_id, seq),
        )
        return [json_value(event) for (event,) in rows]

    async def last(self, response_id: str) -> int:
        """The highest sequence number stored for the response (-1: none)."""
        rows = await self.database.fetch(
            "SELECT MAX(seq) FROM response_events WHERE response_id = ?", (response_id,)
        )
        return -1 if not rows or rows[0][0] is None else int(rows[0][0])

    async def purge(self) -> int:
        """Deletes the events whose response is gone (deleted, expired or evicted)."""
        return await self.database.execute(
            "DELETE FROM response_events WHERE response_id NOT IN (SELECT id FROM responses)"
        )
