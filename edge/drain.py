"""The edge's shutdown state: draining (refuse new work) and ending the streams still open.

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol, TypeVar

from edge.errors import EdgeError, ServerShuttingDownError

# Retry-After on answers refused while draining: another replica can take the request now.
RETRY_AFTER_S = 1.0


class Stoppable(Protocol):
    """A request in flight that can be ended with an error (a stream pump, an event guard)."""

    def stop(self, error: EdgeError) -> None: ...


S = TypeVar("S", bound=Stoppable)


def shutting_down_error() -> ServerShuttingDownError:
    """The 503 a new request gets while the edge drains."""
    return ServerShuttingDownError(
        "The server is shutting down; please retry (another replica will take the request).",
        retry_after=RETRY_AFTER_S,
    )


class Drain:
    """Shutdown state of one edge process; use inside its event loop."""

    def __init__(self) -> None:
        self._draining = False
        self._ended = False
        self._guards: set[Stoppable] = set()

    @property
    def draining(self) -> bool:
        """True from :meth:`begin` on: refuse new generation requests, report not ready."""
        return self._draining

    @property
    def in_flight(self) -> int:
        """Requests currently tracked (streams and non-streaming answers being collected)."""
        return len(self._guards)

    def begin(self) -> None:
        """Starts draining; idempotent."""
        self._draining = True

    def end_streams(self) -> int:
        """Ends every tracked request with ``server_shutting_down`` (and any tracked later, at
        once); returns how many were open."""
        self._draining = self._ended = True
        guards = list(self._guards)
        for guard in guards:
            guard.stop(_grace_over_error())
        return len(guards)

    def add(self, request: Stoppable) -> None:
        """Registers ``request`` for :meth:`end_streams` (stopped at once if that already ran)."""
        if self._ended:
            request.stop(_grace_over_error())
        self._guards.add(request)

    def discard(self, request: Stoppable) -> None:
        """Forgets ``request`` (it ended); no-op if it was not registered."""
        self._guards.discard(request)

    @contextlib.contextmanager
    def track(self, request: S) -> Iterator[S]:
        """Registers ``request`` for :meth:`end_streams` while the block runs."""
        self.add(request)
        try:
            yield request
        finally:
            self.discard(request)


def _grace_over_error() -> ServerShuttingDownError:
    return ServerShuttingDownError(
        "The server is shutting down and the request's grace period ended; please retry.",
        retry_after=RETRY_AFTER_S,
    )
