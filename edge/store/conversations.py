"""Conversations: one row per conversation (its owner, metadata and expiry) and its items in order;
read and changed only by the key that made it, kept ``--state-ttl`` after their last change and
counted against ``--state-max-bytes`` (:mod:`edge.store.budget`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edge.store.database import Database, Statement, json_text, json_value
from edge.store.responses import now_ms


@dataclass
class ConversationRecord:
    """One conversation: its id, owner, creation time (Unix seconds) and metadata."""

    id: str
    owner: str
    created_at: int
    metadata: dict[str, str]

    def answer(self) -> dict[str, Any]:
        """The Conversation object."""
        return {
            "id": self.id,
            "object": "conversation",
            "created_at": self.created_at,
            "metadata": self.metadata,
        }


class ConversationStore:
    """The ``conversations`` and ``conversation_items`` tables' operations."""

    def __init__(self, database: Database, ttl_s: float) -> None:
        self.database = database
        self.ttl_ms = int(ttl_s * 1000)

    async def create(self, record: ConversationRecord, items: list[dict[str, Any]]) -> None:
        """Inserts ``record`` and its first ``items``."""
        metadata = json_text(record.metadata)
        await self.database.execute(
            "INSERT INTO conversations (id, owner, created_at, expires_at, metadata, size_bytes) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (record.id, record.owner, record.created_at, now_ms() + self.ttl_ms, metadata, _size(metadata)),
        )
        await self.append(record.id, items)

    async def get(self, conversation_id: str, owner: str) -> ConversationRecord | None:
        """The owner's unexpired conversation, else None (another key's too)."""
        rows = await self.database.fetch(
            "SELECT id, owner, created_at, metadata FROM conversations "
            "WHERE id = ? AND owner = ? AND expires_at > ?",
            (conversation_id, owner, now_ms()),
        )
        if not rows:
            return None
        identifier, owner, created_at, metadata = rows[0]
        return ConversationRecord(identifier, owner, int(created_at), json_value(metadata))

    async def update(self, conversation_id: str, owner: str, metadata: dict[str, str]) -> bool:
        """Replaces the owner's conversation's metadata; False when there is none."""
        text = json_text(metadata)
        changed = await self.database.execute(
            "UPDATE conversations SET metadata = ?, size_bytes = ? WHERE id = ? AND owner = ?",
            (text, _size(text), conversation_id, owner),
        )
        return changed > 0

    async def delete(self, conversation_id: str, owner: str) -> bool:
        """Deletes the owner's conversation and its items; False when there is none."""
        changed = await self.database.execute(
            "DELETE FROM conversations WHERE id = ? AND owner = ?", (conversation_id, owner)
        )
        if changed:
            await self.database.execute(
                "DELETE FROM conversation_items WHERE conversation_id = ?", (conversation_id,)
            )
        return changed > 0

    async def append(self, conversation_id: str, items: list[dict[str, Any]]) -> None:
        """Adds ``items`` (each with an ``id``) after the conversation's last, and keeps the
        conversation ``--state-ttl`` from now; nothing when the conversation is gone."""
        await self.database.transaction(self.appending(conversation_id, items))

    def appending(
        self, conversation_id: str, items: list[dict[str, Any]], only_if: Statement | None = None
    ) -> list[Statement]:
        """The statements of :meth:`append`, for a caller's transaction; with ``only_if`` (an SQL
        condition and its parameters) the items are added only where it holds."""
        return appending(conversation_id, items, now_ms() + self.ttl_ms, only_if)

    async def items(self, conversation_id: str) -> list[dict[str, Any]]:
        """The conversation's items, in order."""
        rows = await self.database.fetch(
            "SELECT item FROM conversation_items WHERE conversation_id = ? ORDER BY position",
            (conversation_id,),
        )
        return [json_value(item) for (item,) in rows]

    async def delete_item(self, conversation_id: str, item_id: str) -> bool:
        """Deletes one item of the conversation; False when it has none with that id."""
        changed = await self.database.execute(
            "DELETE FROM conversation_items WHERE conversation_id = ? AND id = ?", (conversation_id, item_id)
        )
        return changed > 0

    async def purge(self) -> int:
        """Deletes the expired conversations and their items; how many conversations."""
        deleted = await self.database.execute("DELETE FROM conversations WHERE expires_at <= ?", (now_ms(),))
        await self.database.execute(
            "DELETE FROM conversation_items WHERE conversation_id NOT IN (SELECT id FROM conversations)"
        )
        return deleted


def appending(
    conversation_id: str, items: list[dict[str, Any]], expires_at: int, only_if: Statement | None = None
) -> list[Statement]:
    """The statements of one append, run in one transaction: the conversation's row is changed
    first, which locks it until the end, so appends through several edges run one after another
    (each numbers its items after the last one committed: never the same positions twice)."""
    statements: list[Statement] = [
        ("UPDATE conversations SET expires_at = ? WHERE id = ?", (expires_at, conversation_id))
    ]
    if items:
        params: list[Any] = [conversation_id, conversation_id]
        for offset, item in enumerate(items):
            text = json_text(item)
            params += [offset, item["id"], text, _size(text)]
        params.append(conversation_id)
        condition = ""
        if only_if is not None:
            condition = f" AND {only_if[0]}"
            params += only_if[1]
        values = ", ".join(["(?, ?, ?, ?)"] * len(items))
        statements.append(
            (
                "INSERT INTO conversation_items (conversation_id, position, id, item, size_bytes) "
                "SELECT ?, last.next + v.column1, v.column2, v.column3, v.column4 FROM "
                "(SELECT COALESCE(MAX(position), -1) + 1 AS next FROM conversation_items "
                f"WHERE conversation_id = ?) AS last, (VALUES {values}) AS v "
                f"WHERE EXISTS (SELECT 1 FROM conversations WHERE id = ?){condition}",
                params,
            )
        )
    return statements


def _size(text: str) -> int:
    """The bytes a JSON text holds, counted against ``--state-max-bytes``."""
    return len(text.encode())
