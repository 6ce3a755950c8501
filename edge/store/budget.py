"""``--state-max-bytes``: the one bound on what stored responses (with their stream events) and
conversations (with their items) hold together, their JSON bytes; above it the purge deletes
what would expire soonest first (a response created, a conversation changed longest ago)."""

from __future__ import annotations

from collections.abc import Sequence

from edge.store.database import Database

#: Each response with its events, each conversation with its metadata and items: one unit
#: (``kind``, ``id``) evicted whole, its bytes, and the running sum from the newest.
_OVER = """
SELECT kind, id FROM (
    SELECT kind, id, SUM(bytes) OVER (ORDER BY expires_at DESC, kind, id) AS kept FROM (
        SELECT 'response' AS kind, r.id AS id, r.expires_at AS expires_at,
            r.size_bytes + COALESCE(e.bytes, 0) AS bytes
        FROM responses AS r LEFT JOIN (
            SELECT response_id, SUM(size_bytes) AS bytes FROM response_events GROUP BY response_id
        ) AS e ON e.response_id = r.id
        UNION ALL
        SELECT 'conversation', c.id, c.expires_at, c.size_bytes + COALESCE(i.bytes, 0)
        FROM conversations AS c LEFT JOIN (
            SELECT conversation_id, SUM(size_bytes) AS bytes FROM conversation_items
            GROUP BY conversation_id
        ) AS i ON i.conversation_id = c.id
    ) AS units
) AS ranked WHERE kept > ?
"""
#: What deleting a unit of each kind deletes: its row, then what belongs to it.
_DELETES = {
    "response": (
        "DELETE FROM responses WHERE id IN ({})",
        "DELETE FROM response_events WHERE response_id IN ({})",
    ),
    "conversation": (
        "DELETE FROM conversations WHERE id IN ({})",
        "DELETE FROM conversation_items WHERE conversation_id IN ({})",
    ),
}
#: Ids deleted per statement (within every back-end's limit on parameters).
_CHUNK = 500


async def evict_over(database: Database, max_bytes: int) -> int:
    """Deletes the units beyond the first ``max_bytes`` (counted from the one that expires
    last), each with what belongs to it; how many (0 when ``max_bytes`` is 0: no limit)."""
    if max_bytes <= 0:
        return 0
    rows = await database.fetch(_OVER, (max_bytes,))
    for kind, statements in _DELETES.items():
        await _delete(database, statements, [identifier for unit, identifier in rows if unit == kind])
    return len(rows)


async def _delete(database: Database, statements: Sequence[str], ids: list[str]) -> None:
    """Runs each of ``statements`` on ``ids``, a chunk at a time."""
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        marks = ", ".join("?" * len(chunk))
        await database.transaction([(sql.format(marks), chunk) for sql in statements])
