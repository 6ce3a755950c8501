"""The store's PostgreSQL implementation (``--state-url postgresql://...``), several edges sharing it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import psycopg

from edge.store.database import Row, Statement, pending, schema_version
from edge.store.schema import VERSION_TABLE

# The advisory lock every edge takes to migrate: one migrates, the others wait and find it done.
_MIGRATION_LOCK = 0x51_1CE


def _placeholders(sql: str) -> str:
    """``?`` placeholders as psycopg's ``%s`` (the store's SQL has no other ``?`` nor ``%``)."""
    return sql.replace("?", "%s")


class PostgresDatabase:
    """One connection (autocommit), reopened when it broke; statements run one at a time."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._connection: psycopg.AsyncConnection[Any] | None = None
        self._lock = asyncio.Lock()

    async def _connected(self) -> psycopg.AsyncConnection[Any]:
        if self._connection is None or self._connection.closed or self._connection.broken:
            self._connection = await psycopg.AsyncConnection.connect(self._url, autocommit=True)
        return self._connection

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        async with self._lock:
            cursor = await (await self._connected()).execute(_placeholders(sql), tuple(params))
            return cursor.rowcount

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        async with self._lock:
            cursor = await (await self._connected()).execute(_placeholders(sql), tuple(params))
            return list(await cursor.fetchall())

    async def transaction(self, statements: Sequence[Statement]) -> list[int]:
        async with self._lock:
            connection = await self._connected()
            changed = []
            async with connection.transaction():
                for sql, params in statements:
                    cursor = await connection.execute(_placeholders(sql), tuple(params))
                    changed.append(cursor.rowcount)
            return changed

    async def migrate(self) -> int:
        async with self._lock:
            connection = await self._connected()
            async with connection.transaction():
                await connection.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
                await connection.execute(VERSION_TABLE)
                cursor = await connection.execute("SELECT version FROM sluice_schema")
                version = schema_version(list(await cursor.fetchall()))
                for number, statements in pending(version):
                    for statement in statements:
                        await connection.execute(statement)
                    await connection.execute("DELETE FROM sluice_schema")
                    await connection.execute("INSERT INTO sluice_schema (version) VALUES (%s)", (number,))
                    version = number
            return version

    async def close(self) -> None:
        async with self._lock:
            if self._connection is not None:
                await self._connection.close()
