"""Which database the store uses: PostgreSQL for ``--state-url``, else SQLite under ``--state-dir``."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from edge.store.batches import BatchStore
from edge.store.budget import evict_over
from edge.store.conversations import ConversationStore
from edge.store.database import Database, SqliteDatabase
from edge.store.events import EventStore
from edge.store.files import FileStore
from edge.store.postgres import PostgresDatabase
from edge.store.responses import ResponseStore, Retention

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/sluice`` (``~/.local/state/sluice`` when unset): ``make run``'s store."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "sluice"


def connect(state_dir: str | None, state_url: str | None) -> Database:
    """The database: ``state_url``'s PostgreSQL when given, else the SQLite file in ``state_dir``."""
    if state_url is not None:
        return PostgresDatabase(state_url)
    return SqliteDatabase(Path(state_dir) if state_dir else default_state_dir())


async def open_store(state_dir: str | None, state_url: str | None, retention: Retention) -> ResponseStore:
    """Connects, migrates the schema to the current version and purges what expired."""
    store = ResponseStore(connect(state_dir, state_url), retention)
    await store.database.migrate()
    await purge(store)
    return store


async def purge(store: ResponseStore) -> int:
    """Deletes what expired: responses with their stream events, conversations, files, batches;
    then, over ``--state-max-bytes``, the responses and conversations that expire soonest."""
    ttl_s = store.retention.ttl_s
    deleted = await store.purge()
    deleted += await EventStore(store.database).purge()
    deleted += await ConversationStore(store.database, ttl_s).purge()
    deleted += await FileStore(store.database, ttl_s).purge()
    deleted += await BatchStore(store.database, ttl_s).purge()
    return deleted + await evict_over(store.database, store.retention.max_bytes)


class StoreHandle:
    """The app's one store, opened on first use (``before_serving`` opens it at start-up, so a bad
    URL or database stops the edge there) and closed at shutdown."""

    def __init__(self, state_dir: str | None, state_url: str | None, retention: Retention) -> None:
        self._args = (state_dir, state_url, retention)
        self._store: ResponseStore | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> ResponseStore:
        async with self._lock:
            if self._store is None:
                self._store = await open_store(*self._args)
            return self._store

    async def files(self) -> FileStore:
        """The Batch API's files, in the same database."""
        store = await self.get()
        return FileStore(store.database, store.retention.ttl_s)

    async def events(self) -> EventStore:
        """Background responses' stream events, in the same database."""
        return EventStore((await self.get()).database)

    async def conversations(self) -> ConversationStore:
        """Conversations and their items, in the same database."""
        store = await self.get()
        return ConversationStore(store.database, store.retention.ttl_s)

    async def batches(self) -> BatchStore:
        """The Batch API's batches and their lines, in the same database."""
        store = await self.get()
        return BatchStore(store.database, store.retention.ttl_s)

    async def close(self) -> None:
        async with self._lock:
            if self._store is not None:
                await self._store.database.close()
                self._store = None
