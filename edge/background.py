"""Work that outlives its request (background Responses): tasks by key, cancelled at shutdown."""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("sluice.edge")


class BackgroundTasks:
    """The tasks this process runs for requests that already answered, by key (a response id)."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def spawn(
        self, key: str, work: Coroutine[Any, Any, None], context: contextvars.Context | None = None
    ) -> asyncio.Task[None]:
        """Runs ``work`` in its own task (in ``context``, else a copy of the current one; the
        caller's disconnect does not cancel it)."""
        task = asyncio.create_task(work, name=f"background {key}", context=context)
        self._tasks[key] = task
        task.add_done_callback(lambda done: self._done(key, done))
        return task

    def _done(self, key: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(key) is task:
            del self._tasks[key]
        if not task.cancelled() and task.exception() is not None:
            log.error("background work %s failed", key, exc_info=task.exception())

    def cancel(self, key: str) -> bool:
        """Cancels the task for ``key`` if this process runs it."""
        task = self._tasks.get(key)
        if task is None:
            return False
        task.cancel()
        return True

    async def close(self) -> None:
        """Cancels every task and waits for their ends (their cleanup runs)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __len__(self) -> int:
        return len(self._tasks)
