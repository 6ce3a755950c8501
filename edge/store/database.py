"""The one interface the store speaks to a database, and its embedded SQLite implementation."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from edge.store.schema import MIGRATIONS, VERSION_TABLE

Row = tuple[Any, ...]
#: The SQLite file under ``--state-dir``.
SQLITE_FILE = "edge-state.sqlite3"


def json_text(value: Any) -> str:
    """A stored value's JSON text, written by the standard encoder: a client's body may hold an
    integer of any size in a field the edge ignores (orjson refuses those past 64 bits)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def json_value(text: str | bytes) -> Any:
    """A stored JSON text's value, integers of any size kept exact (:func:`json_text`)."""
    return json.loads(text)


#: One statement and its parameters.
Statement = tuple[str, Sequence[Any]]


class Database(Protocol):
    """SQL with ``?`` placeholders, run one statement at a time (autocommit), or several in one
    transaction."""

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Runs one statement; the number of rows it changed."""
        ...

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Runs one query; its rows."""
        ...

    async def transaction(self, statements: Sequence[Statement]) -> list[int]:
        """Runs ``statements`` in order in one transaction (all or none); the rows each changed.
        A row a statement changes stays locked until the end: another edge's transaction that
        changes it waits (PostgreSQL), and SQLite runs one writing transaction at a time."""
        ...

    async def migrate(self) -> int:
        """Applies the migrations not applied yet, each in one transaction, with other edges
        locked out meanwhile; the schema version after."""
        ...

    async def close(self) -> None: ...


def pending(version: int) -> list[tuple[int, tuple[str, ...]]]:
    """The migrations after ``version``, numbered."""
    return [(n, MIGRATIONS[n - 1]) for n in range(version + 1, len(MIGRATIONS) + 1)]


class SqliteDatabase:
    """One SQLite file (WAL: the edge processes of one host share it), its calls run on a thread,
    one at a time."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / SQLITE_FILE
        self._connection = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._connection.execute("PRAGMA journal_mode=WAL")
        # Another process's write holds the lock for milliseconds: wait for it, do not fail.
        self._connection.execute("PRAGMA busy_timeout=10000")
        # Held in the thread, not by the awaiting task: a call cancelled while its statement runs
        # keeps the connection until the statement ends (two threads on one connection, or a close
        # under a running statement, crash the process).
        self._lock = threading.Lock()

    async def _run(self, work: Any, *args: Any) -> Any:
        return await asyncio.to_thread(self._locked, work, *args)

    def _locked(self, work: Any, *args: Any) -> Any:
        with self._lock:
            return work(*args)

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        return int(await self._run(lambda: self._connection.execute(sql, tuple(params)).rowcount))

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return list(await self._run(lambda: self._connection.execute(sql, tuple(params)).fetchall()))

    async def transaction(self, statements: Sequence[Statement]) -> list[int]:
        return list(await self._run(self._transaction, statements))

    def _transaction(self, statements: Sequence[Statement]) -> list[int]:
        db = self._connection
        db.execute("BEGIN IMMEDIATE")  # the write lock from the start: no stale read to upgrade
        try:
            changed = [db.execute(sql, tuple(params)).rowcount for sql, params in statements]
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return changed

    async def migrate(self) -> int:
        return int(await self._run(self._migrate))

    def _migrate(self) -> int:
        db = self._connection
        db.execute(VERSION_TABLE)
        db.execute("BEGIN IMMEDIATE")  # the write lock: another process migrates after us
        try:
            version = schema_version(db.execute("SELECT version FROM sluice_schema").fetchall())
            for number, statements in pending(version):
                for statement in statements:
                    db.execute(statement)
                db.execute("DELETE FROM sluice_schema")
                db.execute("INSERT INTO sluice_schema (version) VALUES (?)", (number,))
                version = number
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return version

    async def close(self) -> None:
        await self._run(self._connection.close)


def schema_version(rows: list[Row]) -> int:
    """The schema version from ``SELECT version FROM sluice_schema`` (0: none applied)."""
    return int(rows[0][0]) if rows else 0
