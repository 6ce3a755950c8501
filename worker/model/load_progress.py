"""How far the model load has come: written by the loader thread, read by the gRPC service.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable

# How often a waiting call looks at the fraction, and how long it may stay silent: a repeated
# event keeps the caller's idle timer (and its clients' read timeouts) from firing.
POLL_S = 0.2
REPEAT_S = 5.0


class LoadProgress:
    """A monotonic load fraction, safe to set from the loader thread and read from the loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fraction = 0.0

    @property
    def fraction(self) -> float:
        with self._lock:
            return self._fraction

    def advance(self, fraction: float) -> None:
        """Raises the fraction to ``fraction`` (clamped to [0, 1]); never lowers it."""
        value = min(max(fraction, 0.0), 1.0)
        with self._lock:
            self._fraction = max(self._fraction, value)


async def wait_for_load(
    progress: LoadProgress, is_loaded: Callable[[], bool], wait_s: float
) -> AsyncIterator[float]:
    """Yields the load fraction when it changes (and every :data:`REPEAT_S` seconds unchanged,
    the first time at once) until ``is_loaded()`` or ``wait_s`` seconds have passed; the caller
    checks ``is_loaded()`` afterwards to tell the two apart."""
    deadline = time.monotonic() + wait_s
    last: float | None = None
    last_at = 0.0
    while not is_loaded():
        now = time.monotonic()
        if now >= deadline:
            return
        fraction = progress.fraction
        if fraction != last or now - last_at >= REPEAT_S:
            last, last_at = fraction, now
            yield fraction
        await asyncio.sleep(min(POLL_S, max(0.0, deadline - now)))
