"""Files of the Batch API: uploaded batch input and produced batch output, content in the store's
``files`` table (text: JSONL is UTF-8), readable only by the key that owns them, kept until
deleted or ``--state-ttl`` after their creation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edge.store.database import Database
from edge.store.responses import now_ms

_COLUMNS = "id, owner, created_at, expires_at, purpose, filename, bytes"


@dataclass(frozen=True)
class StoredFile:
    """One file's metadata (its content is read apart: :meth:`FileStore.content`)."""

    id: str
    owner: str
    created_at: int  # seconds
    expires_at: int  # milliseconds
    purpose: str
    filename: str
    bytes: int

    def object(self) -> dict[str, Any]:
        """The OpenAI File object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "expires_at": self.expires_at // 1000,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


class FileStore:
    """The ``files`` table's operations; every read and change names the owner."""

    def __init__(self, database: Database, ttl_s: float) -> None:
        self.database = database
        self.ttl_ms = int(ttl_s * 1000)

    async def put(self, file: StoredFile, content: str) -> None:
        """Inserts ``file`` with its ``content`` (replacing a file of the same id and owner: a
        batch's output written again after a restart)."""
        await self.database.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file.id, file.owner))
        await self.database.execute(
            f"INSERT INTO files ({_COLUMNS}, content) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                file.id,
                file.owner,
                file.created_at,
                file.expires_at,
                file.purpose,
                file.filename,
                file.bytes,
                content,
            ),
        )

    def expiry(self) -> int:
        """When a file made now expires (milliseconds)."""
        return now_ms() + self.ttl_ms

    async def get(self, file_id: str, owner: str) -> StoredFile | None:
        """The owner's unexpired file ``file_id``, else None (another key's too)."""
        rows = await self.database.fetch(
            f"SELECT {_COLUMNS} FROM files WHERE id = ? AND owner = ? AND expires_at > ?",
            (file_id, owner, now_ms()),
        )
        return _file(rows[0]) if rows else None

    async def content(self, file_id: str, owner: str) -> str | None:
        """The owner's file's content, else None."""
        rows = await self.database.fetch(
            "SELECT content FROM files WHERE id = ? AND owner = ? AND expires_at > ?",
            (file_id, owner, now_ms()),
        )
        return str(rows[0][0]) if rows else None

    async def owned(self, owner: str, purpose: str | None) -> list[StoredFile]:
        """The owner's unexpired files, newest first (of ``purpose`` when given)."""
        where, params = "owner = ? AND expires_at > ?", [owner, now_ms()]
        if purpose is not None:
            where, params = where + " AND purpose = ?", [*params, purpose]
        rows = await self.database.fetch(
            f"SELECT {_COLUMNS} FROM files WHERE {where} ORDER BY created_at DESC, id DESC", params
        )
        return [_file(row) for row in rows]

    async def delete(self, file_id: str, owner: str) -> bool:
        """Deletes the owner's file; False when there is none."""
        return (
            await self.database.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)) > 0
        )

    async def purge(self) -> int:
        """Deletes the expired files; how many."""
        return await self.database.execute("DELETE FROM files WHERE expires_at <= ?", (now_ms(),))


def _file(row: tuple[Any, ...]) -> StoredFile:
    identifier, owner, created_at, expires_at, purpose, filename, size = row
    return StoredFile(identifier, owner, int(created_at), int(expires_at), purpose, filename, int(size))
