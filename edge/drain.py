"""The edge's shutdown state: draining (refuse new work) and ending the streams still open.

Order on SIGTERM (driven by :mod:`edge.__main__`):

1. :meth:`Drain.begin`: ``/ready`` answers 503 and new generation requests get
   503 ``server_shutting_down`` with ``Retry-After``; the listener stays open
   for ``--drain-delay`` seconds so load balancers see readiness flip first;
2. the listener closes; requests in flight go on for ``--graceful-timeout``;
3. :meth:`Drain.end_streams`: every request still in flight ends with an
   ``event: error`` (``server_shutting_down``) and ``data: [DONE]`` (a
   non-streaming one with a 503), so no client sees a connection cut mid-JSON;
4. hypercorn closes what is left and the process exits 0.

Requests take part by registering something that can be stopped with an
error: a stream's pump (:meth:`Drain.add`, :meth:`Drain.discard`) or a
non-streamed request's :class:`~edge.deadlines.EventGuard` (:meth:`Drain.track`).
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
