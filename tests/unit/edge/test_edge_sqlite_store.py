"""The embedded SQLite store's calls: one statement at a time on its connection, even when the task
awaiting one is cancelled while its thread still runs it (two threads on one connection, or a
close under a running statement, crash the process)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from edge.store.database import SqliteDatabase


def test_a_cancelled_call_keeps_the_connection_until_its_statement_ends(tmp_path: Path) -> None:
    asyncio.run(_scenario(tmp_path))


async def _scenario(tmp_path: Path) -> None:
    database = SqliteDatabase(tmp_path)
    started, release = threading.Event(), threading.Event()
    order: list[str] = []

    def slow() -> None:
        started.set()
        release.wait(10)
        order.append("slow")

    running = asyncio.create_task(database._run(slow))
    await asyncio.to_thread(started.wait, 10)
    running.cancel()
    following = asyncio.create_task(database._run(order.append, "next"))
    # Without the connection held for the thread, the next call runs at once beside the first.
    await asyncio.wait({following}, timeout=0.5)
    release.set()
    await following
    assert order == ["slow", "next"]
    await database.close()
